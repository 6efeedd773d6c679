//! Who may call what: checked first in every Binder method.

use crate::config::Permissions;
use crate::error::ServiceError;

/// What a method needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// List models, open sessions, generate.
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
        Access::Use => admin || p.allowed_uids.is_empty() || p.allowed_uids.contains(&caller.uid),
    };
    if allowed {
        Ok(())
    } else {
        Err(ServiceError::PermissionDenied { uid: caller.uid, method })
    }
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
        let p = Permissions { allowed_uids: vec![10001], admin_uids: vec![2000] };
        let app = Caller { uid: 10001, pid: 1 };
        let other = Caller { uid: 10002, pid: 1 };
        let shell = Caller { uid: 2000, pid: 1 };
        assert!(check(&p, app, Access::Use, "generate").is_ok());
        assert!(check(&p, app, Access::Admin, "dump").is_err());
        assert!(check(&p, other, Access::Use, "generate").is_err());
        assert!(check(&p, shell, Access::Admin, "dump").is_ok());
        let open = Permissions { allowed_uids: vec![], admin_uids: vec![] };
        assert!(check(&open, other, Access::Use, "generate").is_ok());
    }
}
