//! Who may call what: checked first in every Binder method.
//!
//! The policy is closed by default: a uid may use the service only if it is an admin
//! (`admin_uids`, llmd's own uid), listed in `allowed_uids`, or `open = true` admits everyone.
//! A session's methods are its owner's alone, admins included: anyone else is told the
//! session is closed (it learns nothing of it).

use crate::config::Permissions;
use crate::error::ServiceError;

/// What a method needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// List models, model info, open sessions, status.
    Use,
    /// dump, prefetch.
    Admin,
}

/// The caller of the current Binder transaction: kernel-vouched uid/pid on kernel Binder, the
/// socket peer's credentials on the Unix-socket transport (a fail-closed sentinel elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub pid: i32,
}

impl Caller {
    /// Read on the Binder thread that is handling the call.
    pub fn current() -> Self {
        Self { uid: rsbinder::get_calling_uid(), pid: rsbinder::get_calling_pid() }
    }
}

/// Whether `caller` is an admin (an admin uid, or llmd's own).
pub fn is_admin(p: &Permissions, caller: Caller) -> bool {
    caller.uid == own_uid() || p.admin_uids.contains(&caller.uid)
}

pub fn check(p: &Permissions, caller: Caller, access: Access, method: &'static str) -> Result<(), ServiceError> {
    let admin = is_admin(p, caller);
    let allowed = match access {
        Access::Admin => admin,
        Access::Use => admin || p.open || p.allowed_uids.contains(&caller.uid),
    };
    if allowed {
        Ok(())
    } else {
        tracing::debug!(uid = caller.uid, pid = caller.pid, method, "permission denied");
        Err(ServiceError::PermissionDenied { uid: caller.uid, method })
    }
}

/// A call on a session: only the uid that opened it may make it (not another app holding its
/// Binder object, not an admin); anyone else gets `SESSION_CLOSED`, as for a session that does
/// not exist.
pub fn check_owner(owner: Caller, caller: Caller, session: u64, method: &'static str) -> Result<(), ServiceError> {
    if caller.uid == owner.uid {
        return Ok(());
    }
    tracing::debug!(
        session,
        owner = owner.uid,
        uid = caller.uid,
        pid = caller.pid,
        method,
        "refused: not the session's owner"
    );
    Err(ServiceError::SessionClosed)
}

/// This process's real uid, read from /proc (no unsafe, no libc).
fn own_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|u| u.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_needs_an_admin_uid_and_use_follows_the_allow_list() {
        let p = Permissions { open: false, allowed_uids: vec![10001], admin_uids: vec![2000] };
        let app = Caller { uid: 10001, pid: 1 };
        let other = Caller { uid: 10002, pid: 1 };
        let shell = Caller { uid: 2000, pid: 1 };
        assert!(check(&p, app, Access::Use, "generate").is_ok());
        assert!(check(&p, app, Access::Admin, "dump").is_err());
        assert!(check(&p, other, Access::Use, "generate").is_err());
        assert!(check(&p, shell, Access::Admin, "dump").is_ok());
        let open = Permissions { open: true, allowed_uids: vec![], admin_uids: vec![] };
        assert!(check(&open, other, Access::Use, "generate").is_ok());
        assert!(check(&open, other, Access::Admin, "dump").is_err());
    }

    /// With no `allowed_uids` and no `open`, only admins may use the service (an empty list
    /// admits no app's uid, not every uid).
    #[test]
    fn the_default_policy_admits_admins_only() {
        let p = Permissions::default();
        let app = Caller { uid: 10001, pid: 1 };
        assert!(check(&p, app, Access::Use, "openSession").is_err());
        assert!(check(&p, app, Access::Admin, "dump").is_err());
        for admin in [0, 2000, own_uid()] {
            let c = Caller { uid: admin, pid: 1 };
            assert!(check(&p, c, Access::Use, "openSession").is_ok(), "uid {admin}");
        }
    }

    #[test]
    fn a_session_is_its_owners_alone() {
        let owner = Caller { uid: 10001, pid: 5 };
        assert!(check_owner(owner, Caller { uid: 10001, pid: 6 }, 1, "generate").is_ok());
        for other in [10002, 2000, 0, own_uid()] {
            let e = check_owner(owner, Caller { uid: other, pid: 1 }, 1, "close").expect_err("refused");
            assert!(matches!(e, ServiceError::SessionClosed), "uid {other}: {e}");
        }
    }
}
