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
Labels that pick the tally pods (never change them on upgrade: the
selector of a StatefulSet or Deployment is immutable).
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
Whether tally runs on PostgreSQL (a Deployment of stateless pods) rather
than on SQLite under Litestream (one StatefulSet pod): "true" or empty.
*/}}
{{- define "tally.postgres" -}}
{{- if eq .Values.storage "postgres" }}true{{ end }}
{{- end }}

{{/*
Whether Litestream's metrics listener runs: only where Litestream does.
*/}}
{{- define "tally.litestreamMetrics" -}}
{{- if and (not (include "tally.postgres" .)) .Values.metrics.litestream.enabled }}true{{ end }}
{{- end }}

{{/*
The pod's termination grace, in seconds: with PostgreSQL the time tally
serves on after SIGTERM (TALLY_SHUTDOWN_DELAY), tally's drain, the
writer's drain, Litestream's final sync (SQLite only) and a margin. The
same values are rendered into TALLY_SHUTDOWN_DELAY, TALLY_DRAIN_TIMEOUT,
TALLY_WRITER_DRAIN_TIMEOUT and shutdown-sync-timeout (configmap.yaml), so
the sum cannot drift from its parts.
*/}}
{{- define "tally.terminationGracePeriodSeconds" -}}
{{- with .Values.shutdown }}
{{- if include "tally.postgres" $ }}
{{- add .endpointDelaySeconds .drainTimeoutSeconds .writerDrainSeconds .marginSeconds }}
{{- else }}
{{- add .drainTimeoutSeconds .writerDrainSeconds .syncTimeoutSeconds .marginSeconds }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The startup probe's failureThreshold: enough periods to cover tally's wait
for the replica (SQLite only) plus a margin (rounded up, at least one), so
the kubelet never restarts a pod that is still inside that wait.
*/}}
{{- define "tally.startupFailureThreshold" -}}
{{- $period := int .Values.probes.startup.periodSeconds }}
{{- $budget := int .Values.probes.startup.marginSeconds }}
{{- if not (include "tally.postgres" .) }}
{{- $budget = add .Values.config.replicaWaitTimeoutSeconds $budget }}
{{- end }}
{{- max 1 (div (add $budget $period -1) $period) }}
{{- end }}

{{/*
Whether the chart creates the Secret, and what goes in it.
*/}}
{{- define "tally.createCredentials" -}}
{{- if not (include "tally.postgres" .) }}
{{- with .Values.replica.credentials }}
{{- if and .accessKeyId .secretAccessKey (not .existingSecret.name) }}true{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tally.createDatabaseUrl" -}}
{{- if include "tally.postgres" . }}
{{- with .Values.postgres }}
{{- if and .url (not .existingSecret) }}true{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tally.createAdminToken" -}}
{{- with .Values.adminToken }}
{{- if and .value (not .existingSecret.name) }}true{{ end }}
{{- end }}
{{- end }}

{{/*
Checks across values that the schema cannot express. Included by the
workload of either storage (statefulset.yaml, deployment.yaml), so every
render runs them.
*/}}
{{- define "tally.validate" -}}
{{- if not .Values.image.repository }}
{{- fail "image.repository is required: build the image from the repository's Dockerfile, push it to a registry your cluster pulls from and name it (--set image.repository=REGISTRY/tally). There is no public tally image: a bare \"tally\" would pull someone else's image, or nothing." }}
{{- end }}
{{- if include "tally.postgres" . }}
{{- include "tally.validatePostgres" . }}
{{- else }}
{{- include "tally.validateSqlite" . }}
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
{{- fail (printf "extraEnv[%d]: %s is set by the chart; set it through the chart's values instead (values.yaml): a second definition would silently replace the chart's, and with it what the chart computes from it (the grace period, the database, the replica path)" $i $e.name) }}
{{- end }}
{{- end }}
{{- if and .Values.adminToken.value .Values.adminToken.existingSecret.name }}
{{- fail "adminToken: set either value or existingSecret.name, not both" }}
{{- end }}
{{- include "tally.validatePorts" . }}
{{- end }}

{{/*
No two listeners of the pod on one port (tally exits at start when its
two share one; Litestream's would fail to bind), and no two ports of the
Service alike (the API server refuses a Service with a duplicate port).
Litestream's listener counts only where it runs (tally.litestreamMetrics).
*/}}
{{- define "tally.validatePorts" -}}
{{- $listeners := list (list "ports.http" (int .Values.ports.http)) (list "ports.metrics" (int .Values.ports.metrics)) }}
{{- if include "tally.litestreamMetrics" . }}
{{- $listeners = append $listeners (list "ports.litestream" (int .Values.ports.litestream)) }}
{{- end }}
{{- range $i, $a := $listeners }}
{{- range $j, $b := $listeners }}
{{- if and (lt $i $j) (eq (index $a 1) (index $b 1)) }}
{{- fail (printf "%s and %s are both %d: each listener of the pod needs a port of its own (tally exits at start when two share one); give one of them another port" (index $a 0) (index $b 0) (index $a 1)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq (int .Values.service.port) (int .Values.ports.metrics) }}
{{- fail (printf "service.port and ports.metrics are both %d: the Service exposes the HTTP API on service.port and tally's metrics on ports.metrics, and a Service's ports must differ; give service.port another port" (int .Values.service.port)) }}
{{- end }}
{{- end }}

{{- define "tally.validateSqlite" -}}
{{- if or .Values.postgres.url .Values.postgres.existingSecret .Values.deployment.autoscaling.enabled }}
{{- fail "postgres.url, postgres.existingSecret and deployment.autoscaling apply to storage=postgres only, and storage is sqlite: set storage=postgres, or remove them (with sqlite tally runs as exactly one pod)" }}
{{- end }}
{{- if not .Values.replica.bucket }}
{{- fail "replica.bucket is required: the S3 bucket Litestream replicates the database to (--set replica.bucket=NAME)" }}
{{- end }}
{{- /*
Credentials in the endpoint's URL would be in clear in both containers'
environment, in the install notes and in Litestream's log at every start.
*/}}
{{- if regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@" .Values.replica.endpoint }}
{{- fail "replica.endpoint carries user information (USER:PASSWORD@ before the host): it would appear in clear in the pod's environment, the install notes and Litestream's log. Give the endpoint without it (https://HOST:PORT) and the credentials in replica.credentials.accessKeyId/secretAccessKey, or in a Secret of your own (replica.credentials.existingSecret.name)" }}
{{- end }}
{{- include "tally.validateSizeLimit" . }}
{{- with .Values.replica.credentials }}
{{- if and .existingSecret.name (or .accessKeyId .secretAccessKey) }}
{{- fail "replica.credentials: set either accessKeyId/secretAccessKey or existingSecret.name, not both" }}
{{- end }}
{{- if and (or .accessKeyId .secretAccessKey) (not (and .accessKeyId .secretAccessKey)) }}
{{- fail "replica.credentials: accessKeyId and secretAccessKey go together" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
persistence.sizeLimit: empty (no limit) or a quantity of at least 64Mi
with a unit of bytes. A bare number would be bytes (512 is half a
kilobyte; a values file's 20 digits overflow to a negative number), and a
lower-case m is milli (512m is 0.512 bytes): both are refused.
*/}}
{{- define "tally.validateSizeLimit" -}}
{{- $v := .Values.persistence.sizeLimit }}
{{- $units := "binary Ki Mi Gi Ti, or decimal k M G T" }}
{{- if or (not (kindIs "string" $v)) (regexMatch `^[0-9]+(\.[0-9]+)?$` (toString $v)) }}
{{- fail (printf "persistence.sizeLimit: %v is a bare number, which Kubernetes reads as bytes: give a quantity with its unit, as a string, such as 2Gi (%s), at least 64Mi" $v $units) }}
{{- end }}
{{- if $v }}
{{- if regexMatch `^[0-9]+(\.[0-9]+)?m$` $v }}
{{- fail (printf "persistence.sizeLimit: %s is milli (a lower-case m), %s thousandths of a byte: for megabytes write %sM or %sMi" $v (trimSuffix "m" $v) (trimSuffix "m" $v) (trimSuffix "m" $v)) }}
{{- end }}
{{- if not (regexMatch `^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)$` $v) }}
{{- fail (printf "persistence.sizeLimit: %q is not a size: give a number and a unit, such as 2Gi (%s), at least 64Mi; empty for no limit" $v $units) }}
{{- end }}
{{- $unit := regexFind "[A-Za-z]+$" $v }}
{{- $factors := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 }}
{{- $bytes := mulf (float64 (trimSuffix $unit $v)) (get $factors $unit) }}
{{- if lt $bytes 67108864.0 }}
{{- fail (printf "persistence.sizeLimit: %s is below 64Mi, too small for the database, its WAL and Litestream's copies of it (about 3 times the database): give at least 64Mi, or leave it empty for no limit" $v) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tally.validatePostgres" -}}
{{- if .Values.restore.timestamp }}
{{- fail "restore.timestamp undoes a mistake from Litestream's replica of the SQLite database, and storage is postgres, which has none: nothing would be restored. Undo it with the PostgreSQL server's own point-in-time recovery, and leave restore.timestamp empty" }}
{{- end }}
{{- with .Values.postgres }}
{{- if and .url .existingSecret }}
{{- fail "postgres: set either url or existingSecret, not both" }}
{{- end }}
{{- if not (or .url .existingSecret) }}
{{- fail "storage=postgres needs the database URL (postgres://USER:PASSWORD@HOST:5432/DB): set postgres.existingSecret (and postgres.existingSecretKey) to a Secret of your own holding it, or postgres.url for the chart to put it in a Secret" }}
{{- end }}
{{- end }}
{{- with .Values.deployment.autoscaling }}
{{- if and .enabled (gt (int .minReplicas) (int .maxReplicas)) }}
{{- fail (printf "deployment.autoscaling: minReplicas (%d) is above maxReplicas (%d)" (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- if and .enabled (not (and $.Values.resources.requests $.Values.resources.requests.cpu)) }}
{{- fail "deployment.autoscaling needs resources.requests.cpu: the autoscaler's CPU target is a share of the request" }}
{{- end }}
{{- end }}
{{- /*
With Litestream's socket set, tally would wait for a Litestream that is
not there and never serve; the other names are Litestream's own.
*/}}
{{- range $i, $e := .Values.extraEnv }}
{{- if regexMatch "^(LITESTREAM_|TALLY_LITESTREAM_|TALLY_REPLICA_)" $e.name }}
{{- fail (printf "extraEnv[%d]: %s belongs to storage=sqlite (Litestream and its replica); with storage=postgres there is no Litestream, and tally must run without it" $i $e.name) }}
{{- end }}
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
The environment of tally on PostgreSQL: the database URL from a Secret
only, and no Litestream at all.
*/}}
{{- define "tally.postgresEnv" -}}
- name: TALLY_DATABASE
  valueFrom:
    secretKeyRef:
      {{- if include "tally.createDatabaseUrl" . }}
      name: {{ include "tally.fullname" . }}
      key: database-url
      {{- else }}
      name: {{ .Values.postgres.existingSecret }}
      key: {{ .Values.postgres.existingSecretKey }}
      {{- end }}
# The root filesystem is read-only: the tmp volume.
- name: TMPDIR
  value: /tmp
- name: TALLY_SHUTDOWN_DELAY
  value: {{ .Values.shutdown.endpointDelaySeconds | int | quote }}
{{- end }}

{{/*
The tally container's environment as the chart sets it (extraEnv comes
after it). tally.validate refuses an extraEnv entry with one of these
names.
*/}}
{{- define "tally.tallyEnv" -}}
{{ include (ternary "tally.postgresEnv" "tally.litestreamEnv" (eq .Values.storage "postgres")) . }}
- name: TALLY_LISTEN
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.http) | quote }}
- name: TALLY_METRICS_LISTEN
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.metrics) | quote }}
- name: TALLY_DRAIN_TIMEOUT
  value: {{ .Values.shutdown.drainTimeoutSeconds | int | quote }}
- name: TALLY_WRITER_DRAIN_TIMEOUT
  value: {{ .Values.shutdown.writerDrainSeconds | int | quote }}
{{- if not (include "tally.postgres" .) }}
- name: TALLY_REPLICA_WAIT_TIMEOUT
  value: {{ .Values.config.replicaWaitTimeoutSeconds | int | quote }}
{{- end }}
- name: TALLY_REQUEST_TIMEOUT
  value: {{ .Values.config.requestTimeoutSeconds | int | quote }}
- name: TALLY_QUEUE_CAPACITY
  value: {{ .Values.config.queueCapacity | int | quote }}
- name: TALLY_MAX_CONNECTIONS
  value: {{ .Values.config.maxConnections | int | quote }}
- name: TALLY_MAX_BATCH
  value: {{ .Values.config.maxBatch | int | quote }}
{{- if not (include "tally.postgres" .) }}
- name: TALLY_SYNCHRONOUS
  value: {{ .Values.config.synchronous | quote }}
{{- end }}
- name: TALLY_READERS
  value: {{ .Values.config.readers | int | quote }}
- name: TALLY_IDEMPOTENCY_KEY_TTL
  value: {{ .Values.config.idempotencyKeyTTL | quote }}
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
Where the pod runs and what it pulls with, the same for the StatefulSet
and the Deployment; at indentation 0, to be nindented into a pod spec.
*/}}
{{- define "tally.podPlacement" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.topologySpreadConstraints }}
{{- /* A constraint without a labelSelector would count no pods. */}}
{{- $constraints := list }}
{{- range . }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "tally.selectorLabels" $ | fromYaml)) }}
{{- end }}
{{- $constraints = append $constraints $constraint }}
{{- end }}
topologySpreadConstraints:
  {{- toYaml $constraints | nindent 2 }}
{{- end }}
{{- end }}

{{/*
checkov renders the chart with `helm template`, whose namespace is
"default"; every resource here goes to the release's namespace.
*/}}
{{- define "tally.checkovNamespaceSkip" -}}
checkov.io/skip1: "CKV_K8S_21=Resources go to the release namespace (helm install -n) or one named in values; checkov renders with Helm's placeholder namespace, default."
{{- end }}
