//! The ingress's routes follow the policy file as the nodes' do.
//!
//! Each node reloads the policy when its file changes (it looks every 250 ms); the
//! ingress read the routes once, at start, so a route a reload added reached the nodes
//! and never the way in. The ingress now looks at the file as often, and a policy
//! that loads replaces the route table at once for every shard (a request reads the
//! table it started with); one that does not keeps the table in use, logged and
//! counted (`dpumesh_ingress_route_reloads_total{result}`). Services still come from
//! the mesh file: a route to a service the ingress knows no node of answers 404 as at
//! start.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use dpumesh_config::{LoadedConfig, RouteTable};
use parking_lot::Mutex;

/// How often the file is looked at (as the nodes do).
pub(crate) const LOOK_EVERY: Duration = Duration::from_millis(250);

/// What tells one version of the file from another without reading it: its
/// modification time, length and inode (an editor's save replaces the file).
type Fingerprint = Option<(SystemTime, u64, u64, u64)>;

fn fingerprint(file: &Path) -> Fingerprint {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(file).ok()?;
    Some((m.modified().ok()?, m.len(), m.dev(), m.ino()))
}

/// The routes in use, and the file they come from.
pub(crate) struct Routes {
    table: ArcSwap<RouteTable>,
    file: PathBuf,
    /// The version last loaded (or tried).
    seen: Mutex<Fingerprint>,
}

impl Routes {
    /// The routes of `file` as it is now.
    pub(crate) fn load(file: &Path) -> anyhow::Result<Self> {
        let seen = fingerprint(file);
        let loaded = LoadedConfig::read(file)?;
        Ok(Self {
            table: ArcSwap::from_pointee(RouteTable::new(&loaded.config, |_| Some(0))),
            file: file.to_owned(),
            seen: Mutex::new(seen),
        })
    }

    /// The table in use.
    pub(crate) fn table(&self) -> arc_swap::Guard<Arc<RouteTable>> {
        self.table.load()
    }

    /// Loads the file again if it changed: `Ok(true)` when its routes are now in use,
    /// an error (the table in use stays) when it does not load.
    pub(crate) fn reload_if_changed(&self) -> anyhow::Result<bool> {
        let now = fingerprint(&self.file);
        {
            let mut seen = self.seen.lock();
            if *seen == now {
                return Ok(false);
            }
            // A file that fails is not tried again until it changes again.
            *seen = now;
        }
        let loaded = LoadedConfig::read(&self.file)?;
        self.table
            .store(Arc::new(RouteTable::new(&loaded.config, |_| Some(0))));
        Ok(true)
    }
}

/// Looks at the file every [`LOOK_EVERY`] until told to stop.
pub(crate) fn spawn_watcher(
    routes: Arc<Routes>,
) -> std::io::Result<(crossbeam_channel::Sender<()>, std::thread::JoinHandle<()>)> {
    let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
    let handle = std::thread::Builder::new()
        .name("dpumesh-ingress-routes".into())
        .spawn(move || {
            while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(LOOK_EVERY)
            {
                match routes.reload_if_changed() {
                    Ok(true) => {
                        metrics::counter!("dpumesh_ingress_route_reloads_total", "result" => "ok")
                            .increment(1);
                        tracing::info!(routes = routes.table().len(), "ingress routes reloaded");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        metrics::counter!("dpumesh_ingress_route_reloads_total", "result" => "failed")
                            .increment(1);
                        tracing::error!(error = %e, "ingress routes not reloaded: the ones in use stay");
                    }
                }
            }
        })?;
    Ok((stop, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        // As an editor saves: a new file renamed over the old one.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    const ONE: &str = "chains: {open: []}\nservices: {svc: {chain: open}}\nroutes: [{path_prefix: /a, service: svc}]\n";

    #[test]
    fn a_changed_file_replaces_the_routes_and_a_bad_one_keeps_them() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.yaml");
        write(&file, ONE);
        let routes = Routes::load(&file).unwrap();
        assert!(routes.table().find("h", "/b").is_none());
        assert!(!routes.reload_if_changed().unwrap(), "unchanged");
        write(
            &file,
            &ONE.replace("routes: [", "routes: [{path_prefix: /b, service: svc}, "),
        );
        assert!(routes.reload_if_changed().unwrap());
        assert!(routes.table().find("h", "/b").is_some(), "the new route");
        assert!(routes.table().find("h", "/a").is_some());
        write(
            &file,
            "routes: [{path_prefix: /c, service: svc, nonsense: 1}]\n",
        );
        let e = routes.reload_if_changed().unwrap_err();
        assert!(e.to_string().contains("nonsense"), "{e}");
        assert!(
            routes.table().find("h", "/b").is_some(),
            "the table in use stays"
        );
        assert!(
            !routes.reload_if_changed().unwrap(),
            "not tried again unchanged"
        );
    }
}
