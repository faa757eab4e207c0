//! Progress for long steps (guest toolchains, precompiling): on a terminal, a spinner
//! with the elapsed time and the tool's latest output line, the tool's whole output
//! printed only if it fails; elsewhere (CI logs, pipes) the output streams as is.

use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A spinner for one step; hidden when stderr is not a terminal.
pub struct Step {
    bar: ProgressBar,
}

impl Step {
    /// Starts a step called `what` (e.g. "building my-filter (Python)").
    pub fn start(what: &str) -> Self {
        let bar = if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {prefix} [{elapsed}] {wide_msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.enable_steady_tick(Duration::from_millis(100));
            bar
        } else {
            eprintln!("{what} ...");
            ProgressBar::hidden()
        };
        bar.set_prefix(what.to_owned());
        Self { bar }
    }

    /// Whether the spinner is drawn (a terminal is attached).
    fn visible(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Ends the step, leaving `summary` on screen when the spinner was shown.
    pub fn finish(self, summary: &str) {
        if self.visible() {
            self.bar.finish_and_clear();
            eprintln!("✓ {summary}");
        }
    }

    /// Runs `cmd` as part of this step. On a terminal its output feeds the spinner and
    /// is printed only when the command fails; elsewhere it is inherited.
    pub fn run(&self, cmd: &mut Command) -> std::io::Result<ExitStatus> {
        if !self.visible() {
            return cmd.status();
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let output = Arc::new(Mutex::new(String::new()));
        let readers: Vec<_> = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        .map(|stream| {
            let bar = self.bar.clone();
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let trimmed = line.trim();
                    if !trimmed.is_empty() {
                        bar.set_message(trimmed.to_owned());
                    }
                    let mut all = output.lock().unwrap_or_else(|e| e.into_inner());
                    all.push_str(&line);
                    all.push('\n');
                }
            })
        })
        .collect();
        let status = child.wait()?;
        for reader in readers {
            let _ = reader.join();
        }
        if !status.success() {
            self.bar.suspend(|| {
                eprint!("{}", output.lock().unwrap_or_else(|e| e.into_inner()));
            });
        }
        Ok(status)
    }
}

impl Drop for Step {
    /// A step that ends in an error takes its spinner with it, so the error that
    /// follows starts on a clean line.
    fn drop(&mut self) {
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
    }
}
