{{/*
Name of the chart, for labels.
*/}}
{{- define "tally.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources, at most 52 characters, not the usual
63: it is also the StatefulSet's name, and the controller labels its pod
controller-revision-hash=<StatefulSet name>-<hash of up to 10 characters>,
a label value that may not pass 63 characters (a longer name gives a
StatefulSet whose pod the API server refuses). If the release name already
contains the chart name it is used as is.
*/}}
{{- define "tally.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tally.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of the release's resources.
*/}}
{{- define "tally.labels" -}}
{{ include "tally.selectorLabels" . }}
{{ include "tally.metaLabels" . }}
{{- end }}

{{/*
Labels of every resource that do not pick pods.
*/}}
{{- define "tally.metaLabels" -}}
helm.sh/chart: {{ include "tally.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tally
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels of the tally pod: the release's labels with podLabels, where a key
in both podLabels and commonLabels takes podLabels' value (the schema keeps
both out of app.kubernetes.io/ and helm.sh/, so neither can change the
selector).
*/}}
{{- define "tally.podLabels" -}}
{{ include "tally.selectorLabels" . }}
helm.sh/chart: {{ include "tally.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tally
{{- with merge (deepCopy .Values.podLabels) .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels that pick the tally pod (never change them on upgrade: a
StatefulSet's selector is immutable).
*/}}
{{- define "tally.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tally.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "tally.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tally.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}; a digest wins over the
tag. The second argument is the default tag.
*/}}
{{- define "tally.imageRef" -}}
{{- $image := index . 0 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default (index . 1) $image.tag) }}
{{- end }}
{{- end }}

{{- define "tally.image" -}}
{{- include "tally.imageRef" (list .Values.image .Chart.AppVersion) }}
{{- end }}

{{/*
The replica's key prefix: unique per release unless set, so that two
releases pointed at one bucket never write one path.
*/}}
{{- define "tally.replicaPath" -}}
{{- default (printf "%s/%s" .Release.Namespace .Release.Name) .Values.replica.path }}
{{- end }}

{{/*
The pod's termination grace, in seconds: tally's drain, the writer's
drain, Litestream's final sync and a margin. The same values are rendered
into TALLY_DRAIN_TIMEOUT and shutdown-sync-timeout (configmap.yaml), so
the sum cannot drift from its parts.
*/}}
{{- define "tally.terminationGracePeriodSeconds" -}}
{{- with .Values.shutdown }}
{{- add .drainTimeoutSeconds .writerDrainSeconds .syncTimeoutSeconds .marginSeconds }}
{{- end }}
{{- end }}

{{/*
The startup probe's failureThreshold: enough periods to cover tally's wait
for the replica plus a margin (rounded up), so the kubelet never restarts
a pod that is still inside that wait.
*/}}
{{- define "tally.startupFailureThreshold" -}}
{{- $period := int .Values.probes.startup.periodSeconds }}
{{- $budget := add .Values.config.replicaWaitTimeoutSeconds .Values.probes.startup.marginSeconds }}
{{- div (add $budget $period -1) $period }}
{{- end }}

{{/*
Whether the chart creates the Secret, and what goes in it.
*/}}
{{- define "tally.createCredentials" -}}
{{- with .Values.replica.credentials }}
{{- if and .accessKeyId .secretAccessKey (not .existingSecret.name) }}true{{ end }}
{{- end }}
{{- end }}

{{- define "tally.createAdminToken" -}}
{{- with .Values.adminToken }}
{{- if and .value (not .existingSecret.name) }}true{{ end }}
{{- end }}
{{- end }}

{{/*
Checks across values that the schema cannot express. Included by the
StatefulSet, so every render runs them.
*/}}
{{- define "tally.validate" -}}
{{- if not .Values.image.repository }}
{{- fail "image.repository is required: build the image from the repository's Dockerfile, push it to a registry your cluster pulls from and name it (--set image.repository=REGISTRY/tally). There is no public tally image: a bare \"tally\" would pull someone else's image, or nothing." }}
{{- end }}
{{- if not .Values.replica.bucket }}
{{- fail "replica.bucket is required: the S3 bucket Litestream replicates the database to (--set replica.bucket=NAME)" }}
{{- end }}
{{- /*
An extraEnv entry with a name the chart sets would come last in the list
and silently win: TALLY_DRAIN_TIMEOUT, say, would break the grace
arithmetic, LITESTREAM_PATH the one-writer-per-path rule.
*/}}
{{- $chartEnv := list }}
{{- range (include "tally.tallyEnv" . | fromYamlArray) }}
{{- $chartEnv = append $chartEnv .name }}
{{- end }}
{{- range $i, $e := .Values.extraEnv }}
{{- if has $e.name $chartEnv }}
{{- fail (printf "extraEnv[%d]: %s is set by the chart; set it through the chart's values instead (values.yaml): a second definition would silently replace the chart's, and with it what the chart computes from it (the grace period, the replica path)" $i $e.name) }}
{{- end }}
{{- end }}
{{- with .Values.replica.credentials }}
{{- if and .existingSecret.name (or .accessKeyId .secretAccessKey) }}
{{- fail "replica.credentials: set either accessKeyId/secretAccessKey or existingSecret.name, not both" }}
{{- end }}
{{- if and (or .accessKeyId .secretAccessKey) (not (and .accessKeyId .secretAccessKey)) }}
{{- fail "replica.credentials: accessKeyId and secretAccessKey go together" }}
{{- end }}
{{- end }}
{{- if and .Values.adminToken.value .Values.adminToken.existingSecret.name }}
{{- fail "adminToken: set either value or existingSecret.name, not both" }}
{{- end }}
{{- end }}

{{/*
The environment Litestream reads (litestream.yml takes everything from
it), shared by the restore init container and the main container so that
both address the same replica. Credentials come from a Secret only.
*/}}
{{- define "tally.litestreamEnv" -}}
- name: TALLY_DATABASE
  value: /data/tally.db
- name: TALLY_LITESTREAM_SOCKET
  value: /data/litestream.sock
# SQLite's and Litestream's temporary files: the root filesystem is
# read-only, the data volume is not.
- name: TMPDIR
  value: /data
- name: LITESTREAM_BUCKET
  value: {{ .Values.replica.bucket | quote }}
- name: LITESTREAM_PATH
  value: {{ include "tally.replicaPath" . | quote }}
- name: LITESTREAM_ENDPOINT
  value: {{ .Values.replica.endpoint | quote }}
- name: LITESTREAM_REGION
  value: {{ .Values.replica.region | quote }}
- name: LITESTREAM_FORCE_PATH_STYLE
  value: {{ .Values.replica.forcePathStyle | toString | quote }}
# Empty turns Litestream's metrics listener off.
- name: LITESTREAM_METRICS_ADDR
  value: {{ ternary (printf ":%d" (int .Values.ports.litestream)) "" .Values.metrics.litestream.enabled | quote }}
{{- $secret := "" }}
{{- $idKey := "" }}
{{- $secretKey := "" }}
{{- with .Values.replica.credentials }}
{{- if .existingSecret.name }}
{{- $secret = .existingSecret.name }}
{{- $idKey = .existingSecret.accessKeyIdKey }}
{{- $secretKey = .existingSecret.secretAccessKeyKey }}
{{- end }}
{{- end }}
{{- if include "tally.createCredentials" . }}
{{- $secret = include "tally.fullname" . }}
{{- $idKey = "access-key-id" }}
{{- $secretKey = "secret-access-key" }}
{{- end }}
{{- if $secret }}
- name: LITESTREAM_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $idKey }}
- name: LITESTREAM_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $secretKey }}
{{- end }}
{{- end }}

{{/*
The tally container's environment as the chart sets it (extraEnv comes
after it). tally.validate refuses an extraEnv entry with one of these
names.
*/}}
{{- define "tally.tallyEnv" -}}
{{ include "tally.litestreamEnv" . }}
- name: TALLY_LISTEN
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.http) | quote }}
- name: TALLY_METRICS_LISTEN
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.metrics) | quote }}
- name: TALLY_DRAIN_TIMEOUT
  value: {{ .Values.shutdown.drainTimeoutSeconds | int | quote }}
- name: TALLY_REPLICA_WAIT_TIMEOUT
  value: {{ .Values.config.replicaWaitTimeoutSeconds | int | quote }}
- name: TALLY_REQUEST_TIMEOUT
  value: {{ .Values.config.requestTimeoutSeconds | int | quote }}
- name: TALLY_QUEUE_CAPACITY
  value: {{ .Values.config.queueCapacity | int | quote }}
- name: TALLY_MAX_BATCH
  value: {{ .Values.config.maxBatch | int | quote }}
- name: TALLY_SYNCHRONOUS
  value: {{ .Values.config.synchronous | quote }}
- name: TALLY_READERS
  value: {{ .Values.config.readers | int | quote }}
- name: TALLY_LOG
  value: {{ .Values.config.log | quote }}
- name: TALLY_LOG_FORMAT
  value: {{ .Values.config.logFormat | quote }}
{{- if include "tally.createAdminToken" . }}
- name: TALLY_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tally.fullname" . }}
      key: admin-token
{{- else if .Values.adminToken.existingSecret.name }}
- name: TALLY_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.adminToken.existingSecret.name }}
      key: {{ .Values.adminToken.existingSecret.key }}
{{- end }}
{{- end }}

{{/*
checkov renders the chart with `helm template`, whose namespace is
"default"; every resource here goes to the release's namespace.
*/}}
{{- define "tally.checkovNamespaceSkip" -}}
checkov.io/skip1: "CKV_K8S_21=Resources go to the release namespace (helm install -n) or one named in values; checkov renders with Helm's placeholder namespace, default."
{{- end }}
