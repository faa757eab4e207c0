//! `dpumesh tap`: the live requests of every node of a mesh that match a query, as
//! Linkerd's `tap` shows them: one line per request (method, path, status, caller,
//! service, latency, each filter's time, verdict and the denying filter), merged
//! from each node's `GET /tap` stream as they come. Secrets are redacted by the nodes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use dpumesh_pingmesh::dashboard::tap::escape;

/// What to tap.
#[derive(Debug, Clone, Args)]
pub struct TapArgs {
    /// The mesh file: its nodes' `admin` addresses are tapped.
    #[arg(long, default_value = "samples/hotel/mesh.yaml")]
    pub mesh: std::path::PathBuf,
    /// Tap these admin addresses instead of the mesh file's.
    #[arg(long = "admin", value_name = "HOST:PORT")]
    pub admins: Vec<SocketAddr>,
    /// Requests to this destination service.
    #[arg(long)]
    pub service: Option<String>,
    /// Requests whose path starts with this.
    #[arg(long)]
    pub path: Option<String>,
    /// A status (`503`) or a class (`5xx`).
    #[arg(long)]
    pub status: Option<String>,
    #[arg(long)]
    pub method: Option<String>,
    /// Requests from this caller (a service, or `ingress`).
    #[arg(long)]
    pub source: Option<String>,
    /// Requests through this route (`*/api`).
    #[arg(long)]
    pub route: Option<String>,
    /// Records a second at most, per node.
    #[arg(long, default_value_t = 100)]
    pub rate: u32,
    /// Stop after this many records.
    #[arg(long)]
    pub count: Option<u64>,
    /// The admin token (a mesh with identities has one: `dpumesh certs
    /// --admin-token`); without it, taps are served to loopback callers only.
    #[arg(long, env = "DPUMESH_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print each record as the node sent it (JSON).
    #[arg(long)]
    pub json: bool,
}

/// Runs the tap until interrupted (or `count` records).
pub fn run(args: TapArgs) -> Result<ExitCode> {
    let (admins, token) = targets(&args)?;
    let query = query(&args);
    let (tx, rx) = mpsc::channel::<(SocketAddr, Result<String>)>();
    for admin in &admins {
        let (tx, query, token, admin) = (tx.clone(), query.clone(), token.clone(), *admin);
        std::thread::spawn(move || {
            let result = stream(admin, &query, token.as_deref(), &mut |line| {
                tx.send((admin, Ok(line))).is_ok()
            });
            let _ = tx.send((admin, result.map(|()| String::new())));
        });
    }
    drop(tx);
    eprintln!(
        "tapping {} node(s){}; Ctrl-C stops",
        admins.len(),
        if query.is_empty() {
            String::new()
        } else {
            format!(" for {query}")
        }
    );
    let mut seen = 0u64;
    let mut failed = 0usize;
    let stdout = std::io::stdout();
    for (admin, line) in rx {
        match line {
            Ok(line) if line.trim().is_empty() => {}
            Ok(line) => {
                let mut out = stdout.lock();
                if args.json {
                    let _ = writeln!(out, "{line}");
                } else {
                    let _ = writeln!(out, "{}", human(&line));
                }
                seen += 1;
                if args.count.is_some_and(|c| seen >= c) {
                    return Ok(ExitCode::SUCCESS);
                }
            }
            Err(e) => {
                eprintln!("dpumesh tap: {admin}: {e:#}");
                failed += 1;
            }
        }
    }
    Ok(if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The admin addresses to tap and the token to send.
fn targets(args: &TapArgs) -> Result<(Vec<SocketAddr>, Option<String>)> {
    if !args.admins.is_empty() {
        return Ok((args.admins.clone(), args.token.clone()));
    }
    let mesh = dpumesh_config::MeshFile::read(&args.mesh)?;
    let admins: Vec<SocketAddr> = mesh.config.nodes.values().filter_map(|n| n.admin).collect();
    if admins.is_empty() {
        bail!(
            "{}: no node has an `admin` address to tap (or give --admin HOST:PORT)",
            args.mesh.display()
        );
    }
    let token = match &args.token {
        Some(t) => Some(t.clone()),
        // The mesh's own admin token, where this user can read its key.
        None => dpumesh_proxy::trust::registration_key(&mesh)
            .ok()
            .flatten()
            .map(|k| dpumesh_identity::admin::admin_token(&k)),
    };
    Ok((admins, token))
}

fn query(args: &TapArgs) -> String {
    let mut q = Vec::new();
    for (name, value) in [
        ("service", &args.service),
        ("path", &args.path),
        ("status", &args.status),
        ("method", &args.method),
        ("source", &args.source),
        ("route", &args.route),
    ] {
        if let Some(v) = value {
            q.push(format!("{name}={}", escape(v)));
        }
    }
    q.push(format!("rate={}", args.rate));
    q.join("&")
}

/// Reads `admin`'s tap stream, handing each line to `line` until it says stop or the
/// stream ends.
fn stream(
    admin: SocketAddr,
    query: &str,
    token: Option<&str>,
    line: &mut dyn FnMut(String) -> bool,
) -> Result<()> {
    let mut conn = TcpStream::connect_timeout(&admin, Duration::from_secs(3))
        .with_context(|| format!("cannot connect to the admin API at {admin}"))?;
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    write!(
        conn,
        "GET /tap?{query} HTTP/1.1\r\nhost: {admin}\r\n{auth}accept: application/x-ndjson\r\n\r\n"
    )?;
    let mut reader = BufReader::new(conn);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP answer: {status_line:?}"))?;
    let mut chunked = false;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 {
            bail!("the answer ended in its head");
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("transfer-encoding")
            && value.trim().eq_ignore_ascii_case("chunked")
        {
            chunked = true;
        }
    }
    if status != 200 {
        let mut body = String::new();
        let _ = reader.take(4096).read_to_string(&mut body);
        bail!("{status}: {}", body.trim());
    }
    // The records, split into lines whatever the chunks' boundaries.
    let mut pending = Vec::new();
    loop {
        let data = if chunked {
            let mut size = String::new();
            if reader.read_line(&mut size)? == 0 {
                return Ok(());
            }
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .with_context(|| format!("bad chunk size {size:?}"))?;
            if n == 0 {
                return Ok(());
            }
            let mut data = vec![0; n + 2];
            reader.read_exact(&mut data)?;
            data.truncate(n);
            data
        } else {
            let mut data = vec![0; 16 * 1024];
            let n = reader.read(&mut data)?;
            if n == 0 {
                return Ok(());
            }
            data.truncate(n);
            data
        };
        pending.extend_from_slice(&data);
        while let Some(at) = pending.iter().position(|b| *b == b'\n') {
            let rest = pending.split_off(at + 1);
            let text = String::from_utf8_lossy(&pending[..at]).into_owned();
            pending = rest;
            if !line(text) {
                return Ok(());
            }
        }
    }
}

/// One record as a line for people.
fn human(line: &str) -> String {
    let Ok(r) = serde_json::from_str::<serde_json::Value>(line) else {
        return line.to_owned();
    };
    let s = |k: &str| r[k].as_str().unwrap_or("-").to_owned();
    let filters = r["filters"]
        .as_array()
        .map(|fs| {
            fs.iter()
                .map(|f| {
                    format!(
                        "{}={:.0}µs",
                        f["filter"].as_str().unwrap_or("?"),
                        f["us"].as_f64().unwrap_or(0.0)
                    )
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    let verdict = match r["denied_by"].as_str() {
        Some(filter) => format!("denied by {filter}"),
        None => s("verdict"),
    };
    format!(
        "{node} {source} -> {service} {method} {path} {status} {ms:.3}ms {verdict} route={route}{grpc}{filters}",
        node = s("node"),
        source = s("source"),
        service = s("service"),
        method = s("method"),
        path = s("path"),
        status = r["status"],
        ms = r["duration_us"].as_f64().unwrap_or(0.0) / 1e3,
        route = s("route"),
        grpc = r["grpc_status"]
            .as_u64()
            .map_or(String::new(), |g| format!(" grpc={g}")),
        filters = if filters.is_empty() {
            String::new()
        } else {
            format!(" filters[{filters}]")
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_as_one_line() {
        let line = r#"{"node":"node-a","source":"ingress","service":"frontend","method":"GET","path":"/hotels","status":401,"duration_us":1500.0,"verdict":"denied","denied_by":"jwt","route":"*/","filters":[{"filter":"jwt","us":12.0}]}"#;
        assert_eq!(
            human(line),
            "node-a ingress -> frontend GET /hotels 401 1.500ms denied by jwt route=*/ filters[jwt=12µs]"
        );
        assert_eq!(escape("/a b?"), "/a%20b%3F");
    }
}
