//! Wakes the config watcher as soon as a watched file is replaced or written
//! (inotify on the folders that hold them), so a reload starts within milliseconds
//! of the change instead of within a polling period.
//!
//! The watcher keeps polling: inotify says nothing about network filesystems, a
//! folder added after the kernel's watch limit, or a file written through a mapping,
//! and the watcher's own check (the text's hash, the files' stamps) decides whether
//! anything changed. An event only makes it look now.

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};

/// What in a watched folder wakes the watcher: a file closed after writing, moved or
/// linked in (an editor's or `kubectl`'s atomic replace, a ConfigMap's `..data` link),
/// created, removed, or touched.
const EVENTS: WatchFlags = WatchFlags::CLOSE_WRITE
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::CREATE)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF);

/// The folders of the watched files, each with the names in it that matter.
pub struct Nudge {
    /// `None` when inotify cannot be had: the watcher only polls.
    fd: Option<OwnedFd>,
    folders: BTreeMap<PathBuf, Folder>,
    /// Whether every folder asked for is watched.
    covered: bool,
}

struct Folder {
    wd: i32,
    names: Vec<Vec<u8>>,
}

impl Nudge {
    pub fn new() -> Self {
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
            .map_err(|e| tracing::warn!(error = %e, "no inotify: config changes are found by polling alone"))
            .ok();
        Self {
            fd,
            folders: BTreeMap::new(),
            covered: false,
        }
    }

    /// Whether inotify watches the folder of every file last given to
    /// [`Nudge::watch`]: the watcher may then poll less often.
    pub fn covers(&self) -> bool {
        self.covered
    }

    /// Watches the folders of `files` (and no others).
    pub fn watch<'a>(&mut self, files: impl IntoIterator<Item = &'a Path>) {
        let Some(fd) = &self.fd else { return };
        self.covered = true;
        let mut wanted: BTreeMap<PathBuf, Vec<Vec<u8>>> = BTreeMap::new();
        for file in files {
            let (Some(folder), Some(name)) = (file.parent(), file.file_name()) else {
                continue;
            };
            let folder = if folder.as_os_str().is_empty() {
                Path::new(".")
            } else {
                folder
            };
            wanted
                .entry(folder.to_owned())
                .or_default()
                .push(name.as_bytes().to_vec());
        }
        self.folders.retain(|folder, watch| {
            let keep = wanted.contains_key(folder);
            if !keep {
                let _ = inotify::remove_watch(fd, watch.wd);
            }
            keep
        });
        for (folder, names) in wanted {
            if let Some(watch) = self.folders.get_mut(&folder) {
                watch.names = names;
                continue;
            }
            match inotify::add_watch(fd, &folder, EVENTS) {
                Ok(wd) => {
                    self.folders.insert(folder, Folder { wd, names });
                }
                // A missing folder or the kernel's watch limit: polling covers it.
                Err(e) => {
                    self.covered = false;
                    tracing::debug!(folder = %folder.display(), error = %e, "not watched by inotify");
                }
            }
        }
    }

    /// Waits until a watched file may have changed, or `at_most`.
    pub fn wait(&mut self, at_most: Duration) {
        let Some(fd) = &self.fd else {
            std::thread::sleep(at_most);
            return;
        };
        let until = Instant::now() + at_most;
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let timeout = rustix::time::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(0) => return,
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    std::thread::sleep(left);
                    return;
                }
            }
            let mut reader = inotify::Reader::new(fd, &mut buf);
            let mut woken = false;
            loop {
                match reader.next() {
                    Ok(event) => {
                        woken |= self.matters(event.wd(), event.events(), event.file_name());
                    }
                    // Drained.
                    Err(rustix::io::Errno::AGAIN) => break,
                    // Unreadable: look anyway.
                    Err(_) => {
                        woken = true;
                        break;
                    }
                }
            }
            if woken {
                return;
            }
        }
    }

    /// Whether an event touches a watched file: one of its names in its folder, a
    /// `..`-name (Kubernetes swaps a ConfigMap volume's `..data` link, and the watched
    /// names are links through it), the folder itself, or lost events.
    fn matters(&self, wd: i32, events: ReadFlags, name: Option<&std::ffi::CStr>) -> bool {
        if events.contains(ReadFlags::QUEUE_OVERFLOW) {
            return true;
        }
        let Some(folder) = self.folders.values().find(|f| f.wd == wd) else {
            return false;
        };
        let Some(name) = name else { return true };
        let name = name.to_bytes();
        name.starts_with(b"..") || folder.names.iter().any(|n| n == name)
    }
}

impl Default for Nudge {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waited(nudge: &mut Nudge, at_most: Duration) -> Duration {
        let started = Instant::now();
        nudge.wait(at_most);
        started.elapsed()
    }

    #[test]
    fn a_replaced_file_wakes_the_watcher_and_a_neighbour_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.yaml");
        std::fs::write(&file, "a").unwrap();
        let mut nudge = Nudge::new();
        nudge.watch([file.as_path()]);
        assert!(nudge.covers());

        // Nothing happens: the wait runs its course.
        assert!(waited(&mut nudge, Duration::from_millis(100)) >= Duration::from_millis(100));

        // Another file in the folder: still no wake.
        let writer = std::thread::spawn({
            let dir = dir.path().to_owned();
            move || {
                std::thread::sleep(Duration::from_millis(50));
                std::fs::write(dir.join("other.log"), "x").unwrap();
            }
        });
        assert!(waited(&mut nudge, Duration::from_millis(400)) >= Duration::from_millis(400));
        writer.join().unwrap();

        // The file replaced the way editors do (written aside, renamed over it).
        let writer = std::thread::spawn({
            let dir = dir.path().to_owned();
            move || {
                std::thread::sleep(Duration::from_millis(50));
                std::fs::write(dir.join("policy.yaml.new"), "b").unwrap();
                std::fs::rename(dir.join("policy.yaml.new"), dir.join("policy.yaml")).unwrap();
            }
        });
        assert!(waited(&mut nudge, Duration::from_secs(30)) < Duration::from_secs(30));
        writer.join().unwrap();
    }

    #[test]
    fn a_folder_no_longer_named_is_let_go() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let mut nudge = Nudge::new();
        nudge.watch([a.path().join("x").as_path(), b.path().join("y").as_path()]);
        assert_eq!(nudge.folders.len(), 2);
        nudge.watch([b.path().join("y").as_path()]);
        assert_eq!(nudge.folders.keys().collect::<Vec<_>>(), [b.path()]);
        // A folder that does not exist cannot be watched: the watcher keeps polling.
        nudge.watch([b.path().join("gone/z").as_path()]);
        assert!(!nudge.covers());
    }
}
