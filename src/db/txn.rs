//! The transaction rules, written once for both engines against
//! [`Store`]: how a batch is applied in one transaction and what each
//! caller's reply is.
//!
//! A batch of increments and checks is applied set-based, a few
//! statements for the whole batch, its idempotency keys claimed in one and
//! their answers stored in another (on a distant PostgreSQL the round
//! trips, not the commands, are what a batch costs; a key sent twice is
//! answered in memory, see [`keyed_and_checked`]); any other batch (and one whose
//! set-based result could differ: an overflowing counter, a row held
//! elsewhere) runs command by command, each in a savepoint of its own, in
//! one lock order, so that one refused command does not take the rest of
//! its batch down and two processes cannot deadlock on the same rows. (On
//! PostgreSQL a batch that found a row held is first cut in halves that
//! share no name and no key, [`halves`], down to the held name's commands.)
//! There a keyed command claims its key in its own savepoint.

use std::collections::{HashMap, HashSet};

use jiff::Timestamp;

use super::{
    Error, budgets,
    command::{Cleared, Command, Queued, Reply},
    counters,
    keys::{self, Kept},
    store::{Store, StoredKey},
};
use crate::meter::{Decision, IdempotencyKey, Name, Refusal};

/// A batch applied: each command's result is set in its own [`Reply`];
/// this is whether the transaction holding them committed. A batch that
/// did not commit answers every caller with this error.
pub(super) type Applied = Result<(), Error>;

/// Applies a batch in one transaction: set-based when it can be, else one
/// command at a time.
pub(super) async fn apply_batch(conn: &mut impl Store, batch: &mut [Queued]) -> Applied {
    apply_by(conn, batch, Pass::Batch, OnHeld::OneByOne).await
}

/// The transactions a batch is applied in, in the order they run, where
/// statements are round trips over a network: the whole batch in one,
/// unless it mixes increments and checks with other commands (an
/// operator's put, delete or reset). Those run command by command, several
/// round trips each on a distant PostgreSQL, and in one transaction with
/// them every write of the batch would too: at 50 ms a batch of a few
/// dozen writes would run past its time limit and fail them all. So the
/// increments and checks not tied to the operator's commands ([`tied`])
/// run first, set-based, in a transaction of their own (they share no
/// name and no key with the rest, and commands on different names
/// commute, see [`lock_order`]); the tied follow in queue order, each run
/// of increments and checks in one transaction, set-based, and each run
/// of operator's commands in one, command by command: a check queued
/// before the delete of its budget is still counted, and one queued after
/// it finds the budget gone. Each part commits before the next begins, and
/// its callers hear its own commit. An operator interleaving commands with
/// the writes on their names costs a transaction per run, a few round
/// trips each, about what those commands cost in one transaction command
/// by command, where every write between them would cost as much.
pub(super) fn transactions(batch: Vec<Queued>) -> Vec<Vec<Queued>> {
    if !mixed(&batch) {
        return vec![batch];
    }
    let tied = tied(&batch);
    // The first part holds the untied; each later one a run of one kind.
    let mut parts: Vec<Vec<Queued>> = vec![Vec::new()];
    for (q, tied) in batch.into_iter().zip(tied) {
        if !tied {
            parts[0].push(q);
            continue;
        }
        let last = parts.len() - 1;
        let kind = parts[last].first().map(|p| set_based(&p.command));
        if last == 0 || kind != Some(set_based(&q.command)) {
            parts.push(Vec::new());
        }
        let last = parts.len() - 1;
        parts[last].push(q);
    }
    parts.retain(|p| !p.is_empty());
    parts
}

/// Which commands of a batch are tied to its operator's commands, to run
/// after the others, in queue order with them: the operator's commands,
/// every command on a name one of them touches, and every command sharing
/// an idempotency key or a name with a tied one, until none is left to
/// tie. So commands on one name keep their queue order across the parts,
/// and the commands sharing a key are all tied or all not: the first part
/// holding a key holds its first command in queue order (within one
/// transaction a key goes to its first command in lock order, see
/// [`firsts_and_repeats`]).
fn tied(batch: &[Queued]) -> Vec<bool> {
    let mut tied: Vec<bool> = batch.iter().map(|q| !set_based(&q.command)).collect();
    loop {
        let (mut names, mut keys) = (HashSet::new(), HashSet::new());
        for (q, _) in batch.iter().zip(&tied).filter(|(_, t)| **t) {
            names.insert(lock_key(&q.command));
            keys.extend(q.key.as_ref().map(|k| k.as_str()));
        }
        let mut more = false;
        for (q, t) in batch.iter().zip(tied.iter_mut()) {
            if !*t
                && (names.contains(&lock_key(&q.command))
                    || q.key.as_ref().is_some_and(|k| keys.contains(k.as_str())))
            {
                *t = true;
                more = true;
            }
        }
        if !more {
            return tied;
        }
    }
}

/// Whether a batch holds both increments or checks and other commands:
/// more than one transaction ([`transactions`]).
pub(super) fn mixed(batch: &[Queued]) -> bool {
    batch.iter().any(|q| set_based(&q.command)) && batch.iter().any(|q| !set_based(&q.command))
}

/// Whether a command can run set-based: an increment or a check.
pub(super) fn set_based(command: &Command) -> bool {
    matches!(command, Command::Increment { .. } | Command::Check { .. })
}

/// Applies commands in one transaction by the rule `pass` names.
pub(super) async fn apply_by(
    conn: &mut impl Store,
    batch: &mut [Queued],
    pass: Pass,
    on_held: OnHeld,
) -> Applied {
    if pass != Pass::Probe {
        match apply_set_based(conn, batch, pass).await {
            Ok(applied) => return applied,
            Err(Fallback::Held(e)) if on_held == OnHeld::GiveBack => return Err(e),
            Err(_) => {}
        }
    }
    one_by_one(conn, batch, pass).await
}

/// What [`apply_by`] does when the set-based try finds a row held by
/// another transaction past its brief lock timeout, without saying which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OnHeld {
    /// Runs the batch command by command: each command waits for its own
    /// row, and only those on held rows are answered row-busy.
    OneByOne,
    /// Gives the held row's error back, nothing committed, so that the
    /// caller can divide the batch ([`halves`]) and find the held rows in
    /// a few set-based transactions: command by command costs several
    /// round trips a command, past a distant server's time limit for a
    /// batch of a few dozen.
    GiveBack,
}

/// Why a batch was not applied set-based ([`apply_set_based`]); nothing of
/// it ran, or its transaction was rolled back.
#[derive(Debug)]
pub(super) enum Fallback {
    /// It holds another kind of command, a counter would overflow, or a
    /// statement failed: one by one tells which command it was.
    OneByOne,
    /// A row it needs is held by another transaction (which one, the error
    /// does not say).
    Held(Error),
}

/// Puts a batch's commands in their [`groups`] (commands sharing no name
/// and no idempotency key across two groups), each group's commands in
/// queue order, the groups in the order of their first commands, and
/// gives where to cut it into two halves of whole groups, as near the
/// middle as a group boundary is; `None` if it is one group. Commands on
/// different names and keys commute ([`lock_order`]), so each half run in a
/// transaction of its own answers every caller as the whole batch in one
/// would have.
pub(super) fn halves(batch: &mut [Queued], groups: &[usize]) -> Option<usize> {
    if !divisible(groups) {
        return None;
    }
    // Where each command goes: by group, stable.
    let mut from: Vec<usize> = (0..batch.len()).collect();
    from.sort_by_key(|&i| groups[i]);
    let mut best: Option<usize> = None;
    let middle = batch.len() / 2;
    for i in 1..from.len() {
        if groups[from[i]] != groups[from[i - 1]]
            && best.is_none_or(|b| i.abs_diff(middle) < b.abs_diff(middle))
        {
            best = Some(i);
        }
    }
    // Moved in place, a cycle of the permutation at a time: position `k`
    // takes the command at `from[k]`.
    let mut placed = vec![false; batch.len()];
    for start in 0..batch.len() {
        let mut k = start;
        while !placed[k] {
            placed[k] = true;
            if from[k] == start {
                break;
            }
            batch.swap(k, from[k]);
            k = from[k];
        }
    }
    best
}

/// Whether a batch's [`groups`] are more than one.
pub(super) fn divisible(groups: &[usize]) -> bool {
    groups.iter().any(|&g| g > 0)
}

/// Each command's group: commands sharing a name or an idempotency key,
/// directly or through others, share a group; groups are numbered by their
/// first command in queue order.
pub(super) fn groups(batch: &[Queued]) -> Vec<usize> {
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let mut parent: Vec<usize> = (0..batch.len()).collect();
    let mut by_name: HashMap<LockKey<'_>, usize> = HashMap::new();
    let mut by_key: HashMap<&str, usize> = HashMap::new();
    for (i, q) in batch.iter().enumerate() {
        // The first command with its name, and with its key.
        let firsts = [
            Some(*by_name.entry(lock_key(&q.command)).or_insert(i)),
            q.key
                .as_ref()
                .map(|k| *by_key.entry(k.as_str()).or_insert(i)),
        ];
        for j in firsts.into_iter().flatten() {
            let (a, b) = (root(&mut parent, i), root(&mut parent, j));
            parent[a.max(b)] = a.min(b);
        }
    }
    let mut numbers: HashMap<usize, usize> = HashMap::new();
    (0..batch.len())
        .map(|i| {
            let r = root(&mut parent, i);
            let next = numbers.len();
            *numbers.entry(r).or_insert(next)
        })
        .collect()
}

/// All increments of the batch in one statement, all checks in a
/// handful, and all idempotency keys claimed in one and stored in
/// another. Increments and checks touch disjoint tables, so running each
/// kind as a group keeps every caller's answer what it would be in queue
/// order. [`Fallback`] (with nothing run, or the transaction rolled back)
/// when the batch must be applied another way: it holds another kind of
/// command, a statement failed, a counter would overflow, or a row it
/// needs is held elsewhere. An error that breaks the transaction
/// ([`Error::breaks_transaction`]) is the whole batch's answer.
pub(super) async fn apply_set_based<S: Store>(
    conn: &mut S,
    batch: &mut [Queued],
    pass: Pass,
) -> Result<Applied, Fallback> {
    // Wary, the set-based try waits for a row only briefly: a row held
    // past that is waited for command by command (`one_by_one`).
    let begin = match pass {
        Pass::Wary | Pass::Hurried | Pass::Halved => S::BEGIN_PROBE,
        Pass::Batch | Pass::Probe => S::BEGIN_SET_BASED,
    };
    let (outcomes, now, commit) = run_set_based(conn, batch, begin).await?;
    if commit.is_ok() {
        answer_in_queue_order(batch, outcomes, now);
    }
    Ok(commit)
}

/// What a set-based batch answers one command.
enum Outcome {
    /// An increment's new value.
    Value(Result<i64, Error>),
    /// A check's decision.
    Decision(Result<Decision, Error>),
    /// The answer stored for the command's idempotency key: it did not run.
    Stored(StoredKey),
    /// Refused without running (its key reused by another command).
    Refused(Error),
}

/// Each command's [`Outcome`], in queue order, the batch's time and the
/// commit; see [`apply_set_based`].
async fn run_set_based<S: Store>(
    conn: &mut S,
    batch: &[Queued],
    begin_with: &'static str,
) -> Result<(Vec<Outcome>, Timestamp, Applied), Fallback> {
    // Any other command, a delete among them: a check queued after the
    // delete of its budget must find it gone, and one queued before it
    // must be counted first; only one by one, in queue order per name,
    // gives both.
    if !batch.iter().all(|q| set_based(&q.command)) {
        return Err(Fallback::OneByOne);
    }
    if batch
        .iter()
        .all(|q| q.key.is_none() && matches!(q.command, Command::Increment { .. }))
    {
        return increments_committed(conn, batch, begin_with).await;
    }
    if let Err(e) = begin(conn, begin_with).await {
        return match e.breaks_transaction() {
            true => Ok((Vec::new(), Timestamp::UNIX_EPOCH, Err(e))),
            false => Err(Fallback::OneByOne),
        };
    }
    match keyed_and_checked(conn, batch).await {
        Ok(Some((outcomes, now))) => Ok((outcomes, now, commit(conn).await)),
        // Lost connection or lost race: the batch's, whichever way it runs.
        Err(e) if e.breaks_transaction() => {
            let _ = conn.exec("ROLLBACK").await;
            Ok((Vec::new(), Timestamp::UNIX_EPOCH, Err(e)))
        }
        Err(e @ Error::Busy(..)) => {
            let _ = conn.exec("ROLLBACK").await;
            Err(Fallback::Held(e))
        }
        // An overflow, or a statement that failed: one by one tells which
        // command it was.
        _ => {
            let _ = conn.exec("ROLLBACK").await;
            Err(Fallback::OneByOne)
        }
    }
}

/// The hottest batch, increments without keys only: the whole transaction
/// in one round trip.
async fn increments_committed<S: Store>(
    conn: &mut S,
    batch: &[Queued],
    begin_with: &'static str,
) -> Result<(Vec<Outcome>, Timestamp, Applied), Fallback> {
    let increments: Vec<(&Name, i64)> = batch.iter().filter_map(increment).collect();
    let started = std::time::Instant::now();
    let applied = counters::increment_many_committed(conn, &increments, begin_with).await;
    let (values, commit) = match applied {
        Ok(Some(values)) => (values, Ok(())),
        Ok(None) => return Err(Fallback::OneByOne),
        // A row held elsewhere: one by one (or in halves), only its
        // commands wait.
        Err(e @ Error::Busy(..)) => {
            let _ = conn.exec("ROLLBACK").await;
            return Err(Fallback::Held(e));
        }
        Err(e) => {
            let _ = conn.exec("ROLLBACK").await;
            (Vec::new(), Err(e))
        }
    };
    crate::kept!(histogram "tally_commit_duration_seconds").record(started.elapsed().as_secs_f64());
    let outcomes = values.into_iter().map(|v| Outcome::Value(Ok(v))).collect();
    Ok((outcomes, Timestamp::UNIX_EPOCH, commit))
}

/// Inside the batch's transaction: claims every idempotency key (one
/// statement; a key already stored answers its command, which does not
/// run), applies the other commands set-based, and stores the answers of
/// the keys claimed (one statement), giving back the claims of commands
/// refused (a check of an unknown budget, say), as a savepoint rolled
/// back would. `None` on an overflow.
///
/// A key sent more than once in the batch (a client's retry queued beside
/// its first try) runs once: its first occurrence ([`firsts_and_repeats`]) with the
/// rest of the batch, and every later one is answered from what that left,
/// in memory, without a statement of its own: the stored answer replayed,
/// the same refusal if the first was refused and this is the same
/// command, `key-reused` for any other command. A different command after
/// a refused first try would run command by command, the key being free
/// again; here it is refused as reusing the key, since the two came at
/// once: so one client cannot make a batch take a round of statements per
/// request (on a distant server, past its time limit, for every caller in
/// it), and every day and row the batch locks is locked in one go, in
/// order. Sent again later, alone, it runs.
async fn keyed_and_checked<S: Store>(
    conn: &mut S,
    batch: &[Queued],
) -> Result<Option<(Vec<Outcome>, Timestamp)>, Error> {
    // The database's clock is a round trip on PostgreSQL: only for checks,
    // which are decided, or replayed, by it.
    let now = match batch.iter().any(|q| q.command.goes_by_the_time()) {
        true => conn.now().await?,
        false => Timestamp::UNIX_EPOCH,
    };
    let mut outcomes: Vec<Option<Outcome>> = batch.iter().map(|_| None).collect();
    let mut keys = KeyStates::new();
    let (firsts, repeats) = firsts_and_repeats(batch);
    if !firsts.is_empty()
        && !apply_firsts(conn, batch, &firsts, now, &mut outcomes, &mut keys).await?
    {
        return Ok(None);
    }
    for i in repeats {
        let q = &batch[i];
        if let Some(key) = &q.key {
            outcomes[i] = Some(keys.answer_again(key, &q.command.fingerprint()));
        }
    }
    let outcomes = outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Outcome::Refused(missing())))
        .collect();
    Ok(Some((outcomes, now)))
}

/// The error of a command a set-based batch produced no result for: if
/// one were ever missing, its caller gets an error rather than a wrong
/// answer.
fn missing() -> Error {
    Error::Internal("the set-based batch produced no result for this command".into())
}

/// The batch's commands that run, every one without a key and each key's
/// first occurrence, and the repeats of keys, each in queue order. Which
/// occurrence of a key is the first goes by [`lock_order`], the order in
/// which the batch, applied command by command, would claim it.
pub(super) fn firsts_and_repeats(batch: &[Queued]) -> (Vec<usize>, Vec<usize>) {
    // Without keys (the hot batch of checks) every command is a first.
    if batch.iter().all(|q| q.key.is_none()) {
        return ((0..batch.len()).collect(), Vec::new());
    }
    let mut seen: HashSet<&str> = HashSet::new();
    let (mut firsts, mut repeats) = (Vec::new(), Vec::new());
    for i in lock_order(batch) {
        match &batch[i].key {
            Some(key) if !seen.insert(key.as_str()) => repeats.push(i),
            _ => firsts.push(i),
        }
    }
    firsts.sort_unstable();
    repeats.sort_unstable();
    (firsts, repeats)
}

/// What each key of the batch holds once its first occurrence ran.
struct KeyStates(HashMap<String, KeyState>);

enum KeyState {
    /// An answer, stored before the batch or in it.
    Stored(StoredKey),
    /// Nothing: the command that claimed it was refused (with this
    /// fingerprint and error), and its claim given back.
    Free(String, Error),
}

impl KeyStates {
    fn new() -> Self {
        KeyStates(HashMap::new())
    }

    /// How a later occurrence of `key` is answered, without running (see
    /// [`keyed_and_checked`]).
    fn answer_again(&self, key: &IdempotencyKey, fingerprint: &str) -> Outcome {
        match self.0.get(key.as_str()) {
            Some(KeyState::Stored(s)) if s.fingerprint == fingerprint => Outcome::Stored(s.clone()),
            Some(KeyState::Free(f, e)) if f == fingerprint => Outcome::Refused(e.clone()),
            Some(_) => Outcome::Refused(Refusal::KeyReused.into()),
            None => Outcome::Refused(missing()),
        }
    }
}

/// The statements of [`keyed_and_checked`]: the commands at `run` (their
/// keys distinct) applied set-based, each keyed one's outcome kept in
/// `keys`. `false` on an overflow.
async fn apply_firsts<S: Store>(
    conn: &mut S,
    batch: &[Queued],
    run: &[usize],
    now: Timestamp,
    outcomes: &mut [Option<Outcome>],
    keys: &mut KeyStates,
) -> Result<bool, Error> {
    let claims: Vec<(usize, &IdempotencyKey, String)> = run
        .iter()
        .filter_map(|&i| {
            let q = &batch[i];
            q.key.as_ref().map(|k| (i, k, q.command.fingerprint()))
        })
        .collect();
    let mut claimed: Vec<(usize, &IdempotencyKey, &str)> = Vec::new();
    if !claims.is_empty() {
        let asked: Vec<(&str, &str)> = claims
            .iter()
            .map(|(_, k, f)| (k.as_str(), f.as_str()))
            .collect();
        let stored = keys::claim_all(conn, &asked).await?;
        for ((i, key, fingerprint), stored) in claims.iter().zip(stored) {
            let Some(s) = stored else {
                claimed.push((*i, *key, fingerprint));
                continue;
            };
            outcomes[*i] = Some(match s.fingerprint == *fingerprint {
                true => Outcome::Stored(s.clone()),
                false => Outcome::Refused(Refusal::KeyReused.into()),
            });
            keys.0.insert(key.as_str().to_owned(), KeyState::Stored(s));
        }
    }
    let to_run: Vec<&Queued> = run
        .iter()
        .filter(|&&i| outcomes[i].is_none())
        .map(|&i| &batch[i])
        .collect();
    let increments: Vec<(&Name, i64)> = to_run.iter().copied().filter_map(increment).collect();
    let checks: Vec<budgets::CheckItem<'_>> = to_run
        .iter()
        .filter_map(|q| q.command.check_item())
        .collect();
    let values = match increments.is_empty() {
        true => Vec::new(),
        false => match counters::increment_many(conn, &increments).await? {
            Some(values) => values,
            None => return Ok(false),
        },
    };
    let decisions = match checks.is_empty() {
        true => Vec::new(),
        false => budgets::check_many(conn, &checks, now).await?,
    };
    let (mut values, mut decisions) = (values.into_iter(), decisions.into_iter());
    for &i in run {
        if outcomes[i].is_none() {
            outcomes[i] = Some(match batch[i].command {
                Command::Check { .. } => {
                    Outcome::Decision(decisions.next().unwrap_or_else(|| Err(missing())))
                }
                _ => Outcome::Value(values.next().ok_or_else(missing)),
            });
        }
    }
    if claimed.is_empty() {
        return Ok(true);
    }
    let mut answers: Vec<(&str, String)> = Vec::new();
    let mut refused: Vec<&str> = Vec::new();
    for (i, key, fingerprint) in claimed {
        let answer = match &outcomes[i] {
            Some(Outcome::Value(Ok(v))) => Ok(v.encode()),
            Some(Outcome::Decision(Ok(d))) => Ok(d.encode()),
            Some(Outcome::Value(Err(e)) | Outcome::Decision(Err(e)) | Outcome::Refused(e)) => {
                Err(e.clone())
            }
            _ => Err(missing()),
        };
        let state = match answer {
            Ok(result) => {
                answers.push((key.as_str(), result.clone()));
                KeyState::Stored(StoredKey {
                    fingerprint: fingerprint.to_owned(),
                    result,
                })
            }
            Err(e) => {
                refused.push(key.as_str());
                KeyState::Free(fingerprint.to_owned(), e)
            }
        };
        keys.0.insert(key.as_str().to_owned(), state);
    }
    keys::remember_all(conn, &answers).await?;
    keys::give_back(conn, &refused).await?;
    Ok(true)
}

/// An increment's name and step; `None` for any other command.
fn increment(q: &Queued) -> Option<(&Name, i64)> {
    match &q.command {
        Command::Increment { name, by, .. } => Some((name, *by)),
        _ => None,
    }
}

/// Which rule commands are applied by, and so how long they wait for a
/// row another transaction holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// [`apply_batch`]: set-based if it can be, else one by one; the lock
    /// timeout for the first such row, briefly for the rest.
    Batch,
    /// The same, but a set-based try waits for a row only briefly, and
    /// command by command the first such row is waited for as a set-based
    /// batch usually waits ([`Store::BEGIN_SET_BASED`], 250 ms on
    /// PostgreSQL), not the whole lock timeout: while rows are known to be
    /// held by another transaction, one more found held costs its batch
    /// little, and another tally process's batch, which holds its rows for
    /// milliseconds, is still waited for.
    Wary,
    /// Rows another transaction was found holding a moment ago (one
    /// command per row): one by one, each waiting for its row only briefly
    /// ([`Store::BEGIN_PROBE`]).
    Probe,
    /// A half of a batch whose set-based try found a row held: a
    /// set-based try waits for a row only briefly (the whole batch's try
    /// has waited for rows another tally process holds for milliseconds),
    /// and command by command the first held row is waited for the whole
    /// lock timeout, as in [`Pass::Batch`].
    Halved,
    /// A later transaction of a batch one of whose commands has already
    /// waited the whole lock timeout (a batch cut in halves around held
    /// rows): set-based if it can be, else one by one, every command
    /// waiting for its row only briefly, as the commands after the first
    /// held row do in one transaction ([`Store::AFTER_BUSY`]).
    Hurried,
}

/// The general path: one transaction, each command in its own
/// savepoint. If the transaction breaks (BEGIN fails, or a savepoint
/// cannot be rolled back because SQLite already rolled everything back,
/// as it does on some I/O errors), the commands after it do not run and
/// every caller gets the error.
async fn one_by_one<S: Store>(conn: &mut S, batch: &mut [Queued], pass: Pass) -> Applied {
    let begin_with = match pass {
        Pass::Batch | Pass::Halved => S::BEGIN,
        Pass::Wary => S::BEGIN_SET_BASED,
        Pass::Probe | Pass::Hurried => S::BEGIN_PROBE,
    };
    let mut broken = begin(conn, begin_with).await.err();
    let began = broken.is_none();
    // Read once per batch, from the database's clock on PostgreSQL (a
    // round trip): only if a command of the batch goes by the time.
    let mut now = Timestamp::UNIX_EPOCH;
    if broken.is_none() && batch.iter().any(|q| q.command.goes_by_the_time()) {
        match conn.now().await {
            Ok(t) => now = t,
            Err(e) => broken = Some(e),
        }
    }
    // Once a command of this batch has waited the whole lock timeout for
    // a row held elsewhere, the commands after it wait only briefly
    // (`Store::AFTER_BUSY`): a session holding many rows would otherwise
    // cost a lock timeout each, one after another, and hold up the whole
    // batch past its deadline. A command whose row is free does not wait at
    // all, whatever else its budget or counter has held.
    // Probing: briefly from the start (`begin_with`).
    let mut waited = matches!(pass, Pass::Probe | Pass::Hurried);
    for i in lock_order(batch) {
        let q = &mut batch[i];
        if let Some(e) = &broken {
            q.command.fail(e.clone());
            continue;
        }
        broken = apply_in_savepoint(conn, q, now).await.err();
        if !waited
            && broken.is_none()
            && let Some(Err(Error::Busy(..))) = q.command.outcome()
            && let Some(shorter) = S::AFTER_BUSY
        {
            waited = true;
            broken = conn.exec(shorter).await.err();
        }
    }
    match broken {
        Some(e) => {
            if began {
                let _ = conn.exec("ROLLBACK").await;
            }
            Err(e)
        }
        None => commit(conn).await,
    }
}

/// The order a batch is applied in: counters before budgets, each by name,
/// commands on one name in queue order (a stable sort). Commands on
/// different names touch different rows and commute, so every caller's
/// answer is one it could have had in queue order; and every tally process
/// takes its row locks in the same order, so two batches with the same
/// names cannot deadlock on them.
fn lock_order(batch: &[Queued]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| lock_key(&batch[i].command));
    order
}

/// What a command locks first, in the order [`lock_order`] sorts by:
/// counters (0) before budgets (1), then the name's bytes. Names compare
/// as Rust strings, byte by byte, as PostgreSQL's `C` collation does: the
/// order of the set-based statements too (`migrations/postgres`).
type LockKey<'a> = (u8, &'a str);

pub(super) fn lock_key(command: &Command) -> LockKey<'_> {
    match command {
        Command::Increment { name, .. } | Command::DeleteCounter { name, .. } => (0, name.as_str()),
        Command::PutBudget { name, .. } | Command::DeleteBudget { name, .. } => (1, name.as_str()),
        Command::Check { budget, .. } | Command::Reset { budget, .. } => (1, budget.as_str()),
    }
}

/// Applies one command inside a savepoint, setting its result. A command
/// that fails is rolled back to its savepoint and answers its own error;
/// the others in the batch are untouched. An error back is the batch's:
/// the savepoint could not be taken or ended, or the command's error broke
/// the transaction.
async fn apply_in_savepoint(conn: &mut impl Store, q: &mut Queued, now: Timestamp) -> Applied {
    if let Err(e) = conn.exec("SAVEPOINT cmd").await {
        q.command.fail(e.clone());
        return Err(e);
    }
    match &q.key {
        None => apply(conn, &mut q.command, now).await,
        Some(key) => apply_once(conn, &mut q.command, key, now).await,
    }
    let failed = match q.command.outcome() {
        // A lost connection, a deadlock or a serialization failure is the
        // whole transaction's, not this command's: the batch is retried or
        // failed as one.
        Some(Err(e)) if e.breaks_transaction() => return Err(e.clone()),
        Some(Ok(())) => false,
        _ => true,
    };
    match failed {
        false => conn.exec("RELEASE cmd").await,
        true => match conn.exec("ROLLBACK TO cmd").await {
            Ok(()) => conn.exec("RELEASE cmd").await,
            Err(e) => Err(e),
        },
    }
}

/// Applies one command and sets its result; `now` is the batch's time
/// ([`Command::goes_by_the_time`]).
async fn apply(conn: &mut impl Store, command: &mut Command, now: Timestamp) {
    match command {
        Command::Increment { name, by, reply } => {
            reply.set(counters::increment(conn, name, *by).await)
        }
        Command::PutBudget { name, spec, reply } => {
            reply.set(budgets::put(conn, name, spec, now).await)
        }
        Command::Check {
            budget,
            visitor,
            day,
            reply,
        } => {
            let item = budgets::CheckItem {
                budget,
                visitor,
                day: *day,
            };
            reply.set(budgets::check(conn, item, now).await)
        }
        Command::Reset {
            budget,
            day,
            visitor,
            reply,
        } => reply.set(
            budgets::reset(conn, budget, *day, visitor.as_ref(), now)
                .await
                .map(|(day, deleted_rows)| Cleared { day, deleted_rows }),
        ),
        Command::DeleteBudget { name, reply } => reply.set(budgets::delete(conn, name).await),
        Command::DeleteCounter { name, reply } => reply.set(counters::delete(conn, name).await),
    }
}

/// Applies a keyed command once: if its key is known, answers what was
/// stored for it (or refuses a different command reusing the key);
/// otherwise applies the command and stores its answer under the key, in
/// the same savepoint. Increments, checks, deletes and resets take keys.
async fn apply_once(
    conn: &mut impl Store,
    command: &mut Command,
    key: &IdempotencyKey,
    now: Timestamp,
) {
    let fingerprint = command.fingerprint();
    let stored = match keys::claim(conn, key, &fingerprint).await {
        Err(e) => return command.fail(e),
        Ok(Some(stored)) if stored.fingerprint != fingerprint => {
            return command.fail(Refusal::KeyReused.into());
        }
        Ok(stored) => stored,
    };
    if let Some(stored) = &stored {
        return replay(command, stored, now);
    }
    apply(conn, command, now).await;
    let remembered = match &*command {
        Command::Increment { reply, .. } => remember(conn, key, reply).await,
        Command::Check { reply, .. } => remember(conn, key, reply).await,
        Command::DeleteBudget { reply, .. } | Command::DeleteCounter { reply, .. } => {
            remember(conn, key, reply).await
        }
        Command::Reset { reply, .. } => remember(conn, key, reply).await,
        _ => Ok(()),
    };
    if let Err(e) = remembered {
        command.fail(e);
    }
}

/// Answers a command with what its idempotency key stored; `now` is the
/// batch's time.
fn replay(command: &mut Command, stored: &StoredKey, now: Timestamp) {
    match command {
        Command::Increment { reply, .. } => reply.set_replayed(keys::replay(stored)),
        // Replayed now: its rate-limit headers count from this batch's
        // time, not the first answer's.
        Command::Check { reply, .. } => {
            reply.set_replayed(keys::replay::<Decision>(stored).map(|d| Decision {
                decided_at: Some(now),
                ..d
            }))
        }
        Command::DeleteBudget { reply, .. } | Command::DeleteCounter { reply, .. } => {
            reply.set_replayed(keys::replay(stored))
        }
        Command::Reset { reply, .. } => reply.set_replayed(keys::replay(stored)),
        other => other.fail(Error::Internal(
            format!("{} takes no key, yet one is stored", other.kind()).into(),
        )),
    }
}

/// Stores a command's answer under its key, if it succeeded.
async fn remember<T: Kept + std::fmt::Debug>(
    conn: &mut impl Store,
    key: &IdempotencyKey,
    reply: &Reply<T>,
) -> Result<(), Error> {
    match reply.value() {
        Some(answer) => keys::remember(conn, key, answer).await,
        None => Ok(()),
    }
}

/// Opens the batch's transaction with `begin` ([`Store::BEGIN`] or
/// [`Store::BEGIN_SET_BASED`]: SQLite's `BEGIN IMMEDIATE`, PostgreSQL's
/// `BEGIN`). If it fails, a transaction may have been
/// left open by a ROLLBACK that failed earlier; then every later BEGIN
/// would fail too, for good, so it is rolled back and BEGIN is tried once
/// more.
async fn begin<S: Store>(conn: &mut S, begin: &'static str) -> Result<(), Error> {
    match conn.exec(begin).await {
        Ok(()) => return Ok(()),
        // A lost connection stays lost: no second try on it.
        Err(e) if e.breaks_transaction() => return Err(e),
        Err(_) => {}
    }
    let _ = conn.exec("ROLLBACK").await;
    conn.exec(begin).await
}

/// COMMIT, timed: its fsync is most of what a durable write waits for.
/// A failed COMMIT may leave the transaction open, so it is rolled back. A
/// COMMIT whose connection was lost may have committed or not
/// ([`Error::at_commit`]).
async fn commit(conn: &mut impl Store) -> Result<(), Error> {
    let started = std::time::Instant::now();
    let r = conn.exec("COMMIT").await;
    crate::kept!(histogram "tally_commit_duration_seconds").record(started.elapsed().as_secs_f64());
    if r.is_err() {
        let _ = conn.exec("ROLLBACK").await;
    }
    r.map_err(Error::at_commit)
}

/// Sets each command of a set-based batch to its [`Outcome`]; `now` is
/// the batch's time, from which a replayed check's rate-limit headers
/// count.
fn answer_in_queue_order(batch: &mut [Queued], outcomes: Vec<Outcome>, now: Timestamp) {
    let mut outcomes = outcomes.into_iter();
    for q in batch {
        match (outcomes.next(), &mut q.command) {
            (Some(Outcome::Value(v)), Command::Increment { reply, .. }) => reply.set(v),
            (Some(Outcome::Decision(d)), Command::Check { reply, .. }) => reply.set(d),
            (Some(Outcome::Stored(stored)), command) => replay(command, &stored, now),
            (Some(Outcome::Refused(e)), command) => command.fail(e),
            (_, command) => command.fail(missing()),
        }
    }
}
