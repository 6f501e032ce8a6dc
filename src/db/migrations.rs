//! What both engines do around sqlx's migrator: nothing to run when every
//! migration this tally knows is applied, and a database a newer tally
//! migrated served all the same (a rollback), with a warning.

use sqlx::migrate::Migrator;

/// Where a database stands against the migrations this tally knows.
#[derive(Debug, PartialEq, Eq)]
pub struct Standing {
    /// Every migration this tally knows is applied, as it knows it (same
    /// checksum, and it succeeded): the migrator has nothing to do.
    pub up_to_date: bool,
    /// Applied migrations this tally does not know: a newer tally's.
    pub newer: Vec<i64>,
    /// Of those, the ones that failed part way.
    pub newer_failed: Vec<i64>,
    /// Migrations are recorded, and none of them is one this tally knows:
    /// another application's table.
    pub foreign: bool,
}

impl Standing {
    /// Whether this tally may run on the database: not on another
    /// application's migrations, nor on a newer tally's that failed part
    /// way (its database is in a state no release was written for).
    pub fn admit(&self) -> Result<(), String> {
        if self.foreign {
            return Err(format!(
                "the database (or schema) holds another application's migrations \
                 (versions {:?}), none of tally's: give tally a database or schema of its own",
                self.newer
            ));
        }
        if !self.newer_failed.is_empty() {
            return Err(format!(
                "migrations {:?} of a newer tally failed part way: finish them with that \
                 release (or repair them by hand) before running this one",
                self.newer_failed
            ));
        }
        Ok(())
    }
}

/// Compares the applied migrations (`version`, `checksum`, `success`; none
/// when the database has no migrations table) with `migrator`'s.
pub fn standing(migrator: &Migrator, applied: &[(i64, Vec<u8>, bool)]) -> Standing {
    let known = || {
        migrator
            .iter()
            .filter(|m| m.migration_type.is_up_migration())
    };
    let up_to_date = known().all(|m| {
        applied
            .iter()
            .any(|(v, sum, ok)| *v == m.version && *sum == *m.checksum && *ok)
    });
    let unknown = || {
        applied
            .iter()
            .filter(|(v, _, _)| !known().any(|m| m.version == *v))
    };
    let newer: Vec<i64> = unknown().map(|(v, _, _)| *v).collect();
    let newer_failed = unknown()
        .filter(|(_, _, ok)| !ok)
        .map(|(v, _, _)| *v)
        .collect();
    let foreign = !applied.is_empty() && newer.len() == applied.len();
    Standing {
        up_to_date,
        newer,
        newer_failed,
        foreign,
    }
}

/// Says, once at start, that a newer tally migrated the database. Every
/// migration is written so that the release before it runs on its result
/// (tables added, and columns that are nullable or have a default; no
/// column dropped, renamed, narrowed or changed in type or collation, no
/// new constraint or trigger that the release before could break): a
/// rollback after an upgrade that migrated works, and so does a rolling
/// upgrade, whose old processes serve on after the migration.
pub fn warn_of_newer(newer: &[i64]) {
    if !newer.is_empty() {
        tracing::warn!(
            migrations = ?newer,
            "the database has migrations this tally does not know: a newer tally migrated it \
             (a rollback). This release runs on it; upgrade again when you can"
        );
    }
}

/// The tables `migrator`'s migrations create (`CREATE TABLE name`), each
/// once, in the order they are created.
pub fn tables(migrator: &Migrator) -> Vec<String> {
    let mut tables: Vec<String> = Vec::new();
    for m in migrator
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
    {
        let words: Vec<&str> = m.sql.as_str().split_whitespace().collect();
        for pair in words.windows(3) {
            if pair[0].eq_ignore_ascii_case("CREATE") && pair[1].eq_ignore_ascii_case("TABLE") {
                let name = pair[2].split('(').next().unwrap_or_default();
                if !name.is_empty() && !tables.iter().any(|t| t == name) {
                    tables.push(name.to_owned());
                }
            }
        }
    }
    tables
}

/// Whether tally may run on a database whose migrations are applied but
/// whose tables `missing` are not there (dropped or renamed by hand):
/// not, since every request that needs one would fail, while the
/// process looked ready.
pub fn admit_tables(missing: &[String]) -> Result<(), String> {
    match missing {
        [] => Ok(()),
        missing => {
            let Named {
                s,
                names,
                are,
                them,
            } = Named::new(missing);
            Err(format!(
                "tally's table{s} {names} {are} missing, though the migrations that create \
                 {them} are recorded as applied (dropped or renamed by hand?): whatever tally \
                 does with {them} would fail. Restore {them} (from a backup, or rename {them} \
                 back), then start tally again",
            ))
        }
    }
}

/// Tables as a message names them (`` `a` `` or `` `a`, `b` ``), with the
/// words that agree with how many.
pub struct Named {
    pub s: &'static str,
    pub names: String,
    pub are: &'static str,
    pub them: &'static str,
}

impl Named {
    pub fn new(tables: &[String]) -> Self {
        let one = tables.len() == 1;
        Named {
            s: if one { "" } else { "s" },
            names: tables
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", "),
            are: if one { "is" } else { "are" },
            them: if one { "it" } else { "them" },
        }
    }
}

/// A migrator that does not refuse a database a newer tally migrated.
pub fn tolerant(mut migrator: Migrator) -> Migrator {
    migrator.set_ignore_missing(true);
    migrator
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables a start looks for are the ones the migrations create.
    #[test]
    fn each_engine_knows_its_tables_from_its_migrations() {
        let common = [
            "counters",
            "budgets",
            "budget_global_usage",
            "budget_visitor_usage",
            "idempotency_keys",
        ];
        let mut pg: Vec<&str> = common.to_vec();
        pg.push("clock_hold");
        assert_eq!(tables(&sqlx::migrate!("./migrations/postgres")), pg);
        let mut sqlite: Vec<&str> = common.to_vec();
        sqlite.extend(["replica_starts", "clock_hold"]);
        assert_eq!(tables(&sqlx::migrate!("./migrations/sqlite")), sqlite);
        assert!(admit_tables(&[]).is_ok());
        let e = admit_tables(&["counters".into()]).unwrap_err();
        assert!(e.starts_with("tally's table `counters` is missing"), "{e}");
        let e = admit_tables(&["counters".into(), "budgets".into()]).unwrap_err();
        assert!(
            e.contains("tables `counters`, `budgets` are missing"),
            "{e}"
        );
    }

    #[test]
    fn standing_against_the_known_migrations() {
        let migrator = sqlx::migrate!("./migrations/postgres");
        let all: Vec<(i64, Vec<u8>, bool)> = migrator
            .iter()
            .map(|m| (m.version, m.checksum.to_vec(), true))
            .collect();
        let (first, second) = (all[0].clone(), all[1].clone());
        assert_eq!(
            standing(&migrator, &all),
            Standing {
                up_to_date: true,
                newer: vec![],
                newer_failed: vec![],
                foreign: false,
            }
        );
        assert!(standing(&migrator, &all).admit().is_ok());
        assert!(standing(&migrator, &[]).admit().is_ok());
        assert!(!standing(&migrator, &[]).up_to_date);
        assert!(!standing(&migrator, std::slice::from_ref(&first)).up_to_date);
        // Failed, or changed since: the migrator must see it (and refuse).
        let failed = (second.0, second.1.clone(), false);
        assert!(!standing(&migrator, &[first.clone(), failed]).up_to_date);
        let changed = (second.0, vec![0u8; 4], true);
        assert!(!standing(&migrator, &[first.clone(), changed]).up_to_date);
        // A newer tally's migration is named, and does not stand in the way.
        let mut newer = all.clone();
        newer.push((99, vec![1], true));
        assert_eq!(
            standing(&migrator, &newer),
            Standing {
                up_to_date: true,
                newer: vec![99],
                newer_failed: vec![],
                foreign: false,
            }
        );
        assert!(standing(&migrator, &newer).admit().is_ok());
        // One that failed part way is a state no release was written for.
        newer.push((100, vec![1], false));
        let e = standing(&migrator, &newer).admit().unwrap_err();
        assert!(e.contains("[100]") && e.contains("failed part way"), "{e}");
        // Another application's table: none of its versions is tally's.
        let theirs = [
            (20240101000000, vec![1], true),
            (20240102000000, vec![2], true),
        ];
        let e = standing(&migrator, &theirs).admit().unwrap_err();
        assert!(e.contains("another application's migrations"), "{e}");
    }
}
