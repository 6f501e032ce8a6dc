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
    let newer = applied
        .iter()
        .map(|(v, _, _)| *v)
        .filter(|v| !known().any(|m| m.version == *v))
        .collect();
    Standing { up_to_date, newer }
}

/// Says, once at start, that a newer tally migrated the database. Every
/// migration is written so that the release before it runs on its result
/// (columns and tables added, never taken away or narrowed, in the same
/// release): a rollback after an upgrade that migrated works.
pub fn warn_of_newer(newer: &[i64]) {
    if !newer.is_empty() {
        tracing::warn!(
            migrations = ?newer,
            "the database has migrations this tally does not know: a newer tally migrated it \
             (a rollback). This release runs on it; upgrade again when you can"
        );
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
                newer: vec![]
            }
        );
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
                newer: vec![99]
            }
        );
    }
}
