//! Who may use a channel: the user of the process at the other end of the socket
//! (`SO_PEERCRED`), the owner of a socket file, and a private directory for sockets.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The user id of this process.
fn own_uid() -> u32 {
    // SAFETY: `geteuid` has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The user id of the process at the other end of `socket`: for a connected socket, the one that
/// connected; for a socket that connected, the one that listened (its credentials when it called
/// `listen`).
fn peer_uid(socket: &UnixStream) -> io::Result<u32> {
    peer_cred(socket).map(|c| c.uid)
}

/// The credentials of the process at the other end of `socket` (`SO_PEERCRED`).
fn peer_cred(socket: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes, and `len` is `cred`'s size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// The process id of the process at the other end of `socket` (as [`peer_uid`] finds its user).
pub(super) fn peer_pid(socket: &UnixStream) -> io::Result<i32> {
    peer_cred(socket).map(|c| c.pid)
}

/// Checks that the process at the other end of `socket` runs as a user in `allowed` (`None`: this
/// process's own user). The error says which user it is, for a message.
pub(super) fn check_peer(socket: &UnixStream, allowed: Option<&[u32]>) -> io::Result<()> {
    let uid = peer_uid(socket)?;
    let ok = match allowed {
        None => uid == own_uid(),
        Some(uids) => uids.contains(&uid),
    };
    if ok {
        return Ok(());
    }
    let expected = match allowed {
        None => format!("this process's own user, uid {}", own_uid()),
        Some(uids) => format!("the allowed uids {uids:?}"),
    };
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("the peer process runs as uid {uid}, not as {expected}"),
    ))
}

/// Fails when `path` exists and belongs to another user, who could have put it there to be
/// connected to or replaced.
pub(super) fn check_owner(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.uid() != own_uid() => Err(not_ours(path, m.uid())),
        _ => Ok(()),
    }
}

fn not_ours(path: &Path, uid: u32) -> Error {
    Error::io(
        format!("using {}", path.display()),
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "it belongs to uid {uid}, not to this process's user (uid {})",
                own_uid()
            ),
        ),
    )
}

/// A path for a socket named `name` in a directory only this user can enter:
/// `$XDG_RUNTIME_DIR/arrow-cuda/` when `XDG_RUNTIME_DIR` is set (a per-user directory the system
/// makes), else `arrow-cuda-UID/` in the temporary directory ([`std::env::temp_dir`], normally
/// `/tmp`). The directory is created with mode 0700 if missing; one that exists must be a real
/// directory (not a link), owned by this user, with no access for anyone else: otherwise another
/// user could have made it first to watch or replace the socket, and this is an error of kind
/// [`std::io::ErrorKind::PermissionDenied`]. `name` must be a plain file name
/// ([`Error::InvalidArgument`] otherwise), so the socket cannot land outside the directory.
pub fn private_socket_path(name: &str) -> Result<PathBuf> {
    if Path::new(name).file_name() != Some(name.as_ref()) {
        return Err(Error::InvalidArgument(format!(
            "socket name {name:?} is not a plain file name"
        )));
    }
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(runtime) => PathBuf::from(runtime).join("arrow-cuda"),
        None => std::env::temp_dir().join(format!("arrow-cuda-{}", own_uid())),
    };
    Ok(private_dir(&dir)?.join(name))
}

/// Creates `dir` with mode 0700, or checks that it is such a directory of this user.
fn private_dir(dir: &Path) -> Result<&Path> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("creating {}", dir.display()), e)),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| Error::io(format!("inspecting {}", dir.display()), e))?;
    let refuse = |why: String| {
        Error::io(
            format!("using {} for sockets", dir.display()),
            io::Error::new(io::ErrorKind::PermissionDenied, why),
        )
    };
    if !m.file_type().is_dir() {
        return Err(refuse("it is not a directory (a link, perhaps)".into()));
    }
    if m.uid() != own_uid() {
        return Err(not_ours(dir, m.uid()));
    }
    if m.mode() & 0o077 != 0 {
        return Err(refuse(format!(
            "its mode is {:o}: other users have access (0700 is needed)",
            m.mode() & 0o777
        )));
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("acipc-access-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    fn refused(dir: &Path) -> String {
        match private_dir(dir) {
            Err(e) if e.io_kind() == Some(io::ErrorKind::PermissionDenied) => e.to_string(),
            other => panic!("{}: expected PermissionDenied, got {other:?}", dir.display()),
        }
    }

    #[test]
    fn socket_names_stay_in_the_directory() {
        for name in ["", ".", "..", "a/b", "/tmp/x.sock", "x/"] {
            assert!(
                matches!(private_socket_path(name), Err(Error::InvalidArgument(m)) if m.contains("plain file name")),
                "{name:?}"
            );
        }
    }

    #[test]
    fn a_private_directory_is_made_or_checked() {
        let base = scratch("private");
        let dir = base.join("arrow-cuda");
        private_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        private_dir(&dir).unwrap();
        // Open to others: refused, not repaired.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(refused(&dir).contains("mode is 755"));
        // A link to a private directory could be swapped: refused.
        let link = base.join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(refused(&link).contains("not a directory"));
        // Another user's directory (only root can make one).
        if std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).is_ok() {
            assert!(refused(&dir).contains("belongs to uid 65534"));
        } else {
            eprintln!("skipped the other user's directory: only root can make one");
        }
        std::fs::remove_dir_all(&base).unwrap();
    }
}
