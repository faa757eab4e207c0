//! `dpumesh store`: an operator's view of a node's BlueCache store (put, get, list,
//! stat, remove), through the node's control channel like any host client.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_host::store::{Item, StoreBuffer, StoreClient};

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Store a file's bytes (or standard input's, with `-`) as KEY.
    Put {
        key: String,
        /// The file (`-`: standard input).
        #[arg(default_value = "-")]
        file: PathBuf,
    },
    /// Write KEY's bytes to a file (or standard output, with `-`).
    Get {
        key: String,
        /// The file (`-`: standard output).
        #[arg(default_value = "-")]
        file: PathBuf,
    },
    /// List the objects whose keys start with PREFIX: size, CRC-32, key.
    Ls {
        #[arg(default_value = "")]
        prefix: String,
    },
    /// Size and CRC-32 of objects.
    Stat {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Remove objects.
    Rm {
        #[arg(required = true)]
        keys: Vec<String>,
    },
}

/// Runs one command against the node at `control`, for `service`'s objects.
pub fn run(
    control: &Endpoint,
    service: &str,
    token: Option<&str>,
    command: StoreCommand,
) -> Result<ExitCode> {
    let client = StoreClient::connect_as(control, "dpumesh-store-cli", service, token)
        .with_context(|| {
            format!("cannot act for {service} on the node's control channel at {control}")
        })?;
    match command {
        StoreCommand::Put { key, file } => put(&client, &key, &file),
        StoreCommand::Get { key, file } => get(&client, &key, &file),
        StoreCommand::Ls { prefix } => {
            for o in client.list(&prefix)? {
                println!("{:>12} {:08x} {}", o.size, o.crc32, o.key);
            }
            Ok(ExitCode::SUCCESS)
        }
        StoreCommand::Stat { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let mut code = ExitCode::SUCCESS;
            for (key, info) in keys.iter().zip(client.stat(&refs)?) {
                match info {
                    Some(o) => println!("{:>12} {:08x} {}", o.size, o.crc32, o.key),
                    None => {
                        eprintln!("{key}: no such object");
                        code = ExitCode::FAILURE;
                    }
                }
            }
            Ok(code)
        }
        StoreCommand::Rm { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let mut code = ExitCode::SUCCESS;
            for (key, result) in keys.iter().zip(client.delete(&refs)?) {
                if result.status != dpumesh_store::protocol::Status::Ok {
                    eprintln!("{key}: {:?}: {}", result.status, result.message);
                    code = ExitCode::FAILURE;
                }
            }
            Ok(code)
        }
    }
}

fn put(client: &StoreClient, key: &str, file: &Path) -> Result<ExitCode> {
    let (buffer, len): (StoreBuffer, usize) = if file == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::stdin().read_to_end(&mut bytes)?;
        let buffer = client.register(bytes.len())?;
        buffer.write(0, &bytes)?;
        (buffer, bytes.len())
    } else {
        let f = File::open(file).with_context(|| format!("cannot open {}", file.display()))?;
        let len = f.metadata()?.len() as usize;
        let buffer = client.register(len)?;
        // Straight from the file into the registered buffer.
        let mut done = 0;
        while done < len {
            let n = buffer
                .region()
                .read_from(f.as_fd(), done as u64, len - done)
                .with_context(|| format!("reading {}", file.display()))?;
            if n == 0 {
                bail!("{} shrank while it was read", file.display());
            }
            done += n;
        }
        (buffer, len)
    };
    let results = client
        .put_batch(&[Item {
            key,
            buffer: &buffer,
            offset: 0,
            len: len as u64,
        }])
        .wait()?;
    let r = &results[0];
    if r.status != dpumesh_store::protocol::Status::Ok {
        bail!("{key}: {:?}: {}", r.status, r.message);
    }
    eprintln!("stored {key}: {} bytes, crc32 {:08x}", r.size, r.crc32);
    Ok(ExitCode::SUCCESS)
}

fn get(client: &StoreClient, key: &str, file: &Path) -> Result<ExitCode> {
    let Some(info) = client.stat(&[key])?.remove(0) else {
        bail!("{key}: no such object");
    };
    let buffer = client.register(info.size as usize)?;
    let results = client
        .get_batch(&[Item {
            key,
            buffer: &buffer,
            offset: 0,
            len: buffer.len() as u64,
        }])
        .wait()?;
    let r = &results[0];
    if r.status != dpumesh_store::protocol::Status::Ok {
        bail!("{key}: {:?}: {}", r.status, r.message);
    }
    let size = r.size as usize;
    if file == Path::new("-") {
        let mut out = std::io::stdout().lock();
        out.write_all(&buffer.read_vec(0, size)?)?;
        out.flush()?;
    } else {
        let f = File::create(file).with_context(|| format!("cannot create {}", file.display()))?;
        let mut done = 0;
        while done < size {
            let n = buffer
                .region()
                .write_to(f.as_fd(), done as u64, size - done)
                .with_context(|| format!("writing {}", file.display()))?;
            done += n;
        }
    }
    Ok(ExitCode::SUCCESS)
}
