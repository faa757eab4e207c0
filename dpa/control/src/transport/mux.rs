//! A host agent's side of the control channel (a Unix socket): many of its threads
//! ask at once (each pod's registration runs on that pod's connection thread), and
//! the node pushes frames nobody asked for (`Wake`, `Teardown`), so one reader
//! thread hands each answer to whoever waits for it and each push to a callback.

use std::sync::atomic::AtomicU32;

use crossbeam_channel::{Sender, bounded};

use super::*;

/// An answer and the descriptors that came with it.
type Answer = (Response, Vec<OwnedFd>);

/// What waits for answers, by request id.
type Pending = Arc<Mutex<HashMap<u32, Sender<Answer>>>>;

/// A control client many threads share.
#[derive(Debug)]
pub struct MuxClient {
    writer: Mutex<UnixStream>,
    pending: Pending,
    next_id: AtomicU32,
    node: String,
    reader: Option<JoinHandle<()>>,
}

impl MuxClient {
    /// Connects to the node's socket at `path`, says Hello as a host named `name`,
    /// and hands every unsolicited frame to `on_push`: a `Wake`, a `Teardown`, and a
    /// last `Teardown` when the connection closes.
    pub fn connect(
        path: &std::path::Path,
        name: &str,
        on_push: impl Fn(Response) + Send + 'static,
    ) -> Result<Self, ControlError> {
        let stream = UnixStream::connect(path)?;
        let reading = stream.try_clone()?;
        let pending: Pending = Arc::default();
        let reader = {
            let pending = pending.clone();
            std::thread::Builder::new()
                .name("dpumesh-agent-link".to_owned())
                .spawn(move || read_loop(reading, &pending, &on_push))?
        };
        let mut client = Self {
            writer: Mutex::new(stream),
            pending,
            next_id: AtomicU32::new(1),
            node: String::new(),
            reader: Some(reader),
        };
        match client.request(Request::Hello {
            role: Role::Host,
            name: name.to_owned(),
        })? {
            Response::Hello { node } => client.node = node,
            other => {
                return Err(ControlError::Body(format!(
                    "unexpected answer to Hello: {other:?}"
                )));
            }
        }
        Ok(client)
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Sends a request and waits for its answer; `Error` answers become
    /// [`ControlError::Refused`].
    pub fn request(&self, request: Request) -> Result<Response, ControlError> {
        self.request_with_fds(request, &[]).map(|(r, _)| r)
    }

    /// [`Self::request`], passing `fds` with it and returning those of the answer.
    pub fn request_with_fds(
        &self,
        request: Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Answer, ControlError> {
        let id = loop {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            // 0 is the id of pushes.
            if id != 0 {
                break id;
            }
        };
        let (tx, rx) = bounded(1);
        self.pending.lock().insert(id, tx);
        let bytes = crate::encode(&Frame::Request(id, request));
        let sent = {
            let mut writer = self.writer.lock();
            if fds.is_empty() {
                writer.write_all(&bytes)
            } else {
                send_with_fds(&mut writer, &bytes, fds)
            }
        };
        if let Err(e) = sent {
            self.pending.lock().remove(&id);
            return Err(e.into());
        }
        match rx.recv() {
            Ok((Response::Error { code, message }, _)) => {
                Err(ControlError::Refused { code, message })
            }
            Ok(answer) => Ok(answer),
            // The reader stopped: the connection closed.
            Err(_) => Err(ControlError::Closed),
        }
    }

    /// Sends a request that is not answered ([`Request::Doorbell`]).
    pub fn notify(&self, request: Request) -> Result<(), ControlError> {
        let bytes = crate::encode(&Frame::Request(0, request));
        self.writer.lock().write_all(&bytes)?;
        Ok(())
    }
}

impl Drop for MuxClient {
    fn drop(&mut self) {
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// Reads frames until the connection closes: answers to their askers, pushes to
/// `on_push`. On leaving, every asker still waiting hears `Closed`.
fn read_loop(mut stream: UnixStream, pending: &Pending, on_push: &dyn Fn(Response)) {
    let mut fds = Vec::new();
    let why = loop {
        let frame = read_frame(&mut FdReader {
            stream: &mut stream,
            fds: &mut fds,
        });
        match frame {
            Ok(Frame::Response(0, push)) => {
                fds.clear();
                on_push(push);
            }
            Ok(Frame::Response(id, response)) => {
                let answer = (response, std::mem::take(&mut fds));
                if let Some(waiting) = pending.lock().remove(&id) {
                    let _ = waiting.send(answer);
                }
            }
            Ok(Frame::Request(..)) => break "the node sent a request".to_owned(),
            Err(ControlError::Closed) => break "the node closed the control connection".to_owned(),
            Err(e) => break e.to_string(),
        }
    };
    pending.lock().clear();
    on_push(Response::Teardown { reason: why });
}
