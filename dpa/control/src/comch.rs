//! The control channel over DOCA Comch (`doca` feature): the same frames as the
//! socket transport, carried as Comch messages, so host and DPU talk without a
//! reachable DPU management address (as BlueCache's control plane does).
//!
//! Comch calls back from inside `doca_pe_progress` on the thread that progresses; the
//! callbacks find their state through a thread-local pointer set only for the length
//! of that call. Compiled (type-checked) wherever the feature is enabled; it needs a
//! BlueField and the DOCA libraries to link and run, and has not been run on hardware.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use doca_sys as sys;

use super::transport::{Handler, Peer};
use super::{ControlError, ErrorCode, Frame, Request, Response, Role, decode, encode};

/// Messages received during one progress call, with the connection they came on.
#[derive(Default)]
struct Inbox {
    messages: VecDeque<(Vec<u8>, *mut sys::doca_comch_connection)>,
    connected: Vec<*mut sys::doca_comch_connection>,
    disconnected: Vec<*mut sys::doca_comch_connection>,
}

thread_local! {
    static INBOX: Cell<*mut Inbox> = const { Cell::new(ptr::null_mut()) };
}

fn progress(pe: *mut sys::doca_pe, inbox: &mut Inbox) -> bool {
    INBOX.with(|cell| cell.set(inbox));
    // SAFETY: the engine is ours; callbacks run inside this call on this thread and
    // reach `inbox` through the thread-local, which is cleared right after.
    let progressed = unsafe { sys::doca_pe_progress(pe) } != 0;
    INBOX.with(|cell| cell.set(ptr::null_mut()));
    progressed
}

fn with_inbox(f: impl FnOnce(&mut Inbox)) {
    INBOX.with(|cell| {
        let p = cell.get();
        if !p.is_null() {
            // SAFETY: set by `progress` to a live `Inbox` for the length of the call
            // that is running this callback.
            f(unsafe { &mut *p });
        }
    });
}

unsafe extern "C" fn on_message(
    _event: *mut sys::doca_comch_event_msg_recv,
    buffer: *mut u8,
    len: u32,
    connection: *mut sys::doca_comch_connection,
) {
    // SAFETY: Comch hands us `len` readable bytes valid for the callback's duration.
    let bytes = unsafe { std::slice::from_raw_parts(buffer, len as usize) }.to_vec();
    with_inbox(|inbox| inbox.messages.push_back((bytes, connection)));
}

unsafe extern "C" fn on_connect(
    _event: *mut sys::doca_comch_event_connection_status_changed,
    connection: *mut sys::doca_comch_connection,
    ok: u8,
) {
    if ok != 0 {
        with_inbox(|inbox| inbox.connected.push(connection));
    }
}

unsafe extern "C" fn on_disconnect(
    _event: *mut sys::doca_comch_event_connection_status_changed,
    connection: *mut sys::doca_comch_connection,
    _ok: u8,
) {
    with_inbox(|inbox| inbox.disconnected.push(connection));
}

unsafe extern "C" fn on_sent(
    task: *mut sys::doca_comch_task_send,
    _task_user_data: sys::doca_data,
    _ctx_user_data: sys::doca_data,
) {
    // SAFETY: the task is finished and ours to free, once.
    unsafe { sys::doca_task_free(sys::doca_comch_task_send_as_task(task)) };
}

fn doca_err(call: &str, code: sys::doca_error_t) -> ControlError {
    // SAFETY: doca_error_get_name returns a static string for any code.
    let name = unsafe {
        let p = sys::doca_error_get_name(code);
        if p.is_null() {
            "unknown".into()
        } else {
            CStr::from_ptr(p).to_string_lossy()
        }
    };
    ControlError::Io(std::io::Error::other(format!(
        "{call} failed: {name} ({code})"
    )))
}

fn check(call: &str, code: sys::doca_error_t) -> Result<(), ControlError> {
    if code == sys::DOCA_SUCCESS {
        Ok(())
    } else {
        Err(doca_err(call, code))
    }
}

fn open_device(pci: &str) -> Result<*mut sys::doca_dev, ControlError> {
    let pci_c = CString::new(pci)
        .map_err(|_| ControlError::Body(format!("{pci:?} is not a PCI address")))?;
    let mut list = ptr::null_mut();
    let mut count = 0u32;
    // SAFETY: out-pointers to locals; the list is destroyed before returning.
    unsafe {
        check(
            "doca_devinfo_create_list",
            sys::doca_devinfo_create_list(&mut list, &mut count),
        )?;
        let mut dev = ptr::null_mut();
        for i in 0..count as usize {
            let info = *list.add(i);
            let mut equal = 0u8;
            if sys::doca_devinfo_is_equal_pci_addr(info, pci_c.as_ptr(), &mut equal)
                == sys::DOCA_SUCCESS
                && equal == 1
            {
                let opened = sys::doca_dev_open(info, &mut dev);
                if opened != sys::DOCA_SUCCESS {
                    sys::doca_devinfo_destroy_list(list);
                    return Err(doca_err("doca_dev_open", opened));
                }
                break;
            }
        }
        sys::doca_devinfo_destroy_list(list);
        if dev.is_null() {
            return Err(ControlError::Io(std::io::Error::other(format!(
                "no DOCA device at PCI address {pci} ({count} devices found)"
            ))));
        }
        Ok(dev)
    }
}

/// The host side: a Comch client speaking the control protocol.
pub struct ComchClient {
    dev: *mut sys::doca_dev,
    pe: *mut sys::doca_pe,
    client: *mut sys::doca_comch_client,
    connection: *mut sys::doca_comch_connection,
    inbox: Inbox,
    next_id: u32,
    /// Frames the server sent unasked (a host agent's `Wake`s), not taken yet.
    pushed: VecDeque<Response>,
}

impl std::fmt::Debug for ComchClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComchClient").finish_non_exhaustive()
    }
}

impl ComchClient {
    /// Connects to the Comch server `server_name` through the device at `pci`, then
    /// says Hello.
    pub fn connect(
        pci: &str,
        server_name: &str,
        role: Role,
        name: &str,
        timeout: Duration,
    ) -> Result<Self, ControlError> {
        let dev = open_device(pci)?;
        let server_c =
            CString::new(server_name).map_err(|_| ControlError::Body("bad server name".into()))?;
        let mut this = Self {
            dev,
            pe: ptr::null_mut(),
            client: ptr::null_mut(),
            connection: ptr::null_mut(),
            inbox: Inbox::default(),
            next_id: 1,
            pushed: VecDeque::new(),
        };
        // SAFETY: handles created here are freed by Drop on every path.
        unsafe {
            check("doca_pe_create", sys::doca_pe_create(&mut this.pe))?;
            check(
                "doca_comch_client_create",
                sys::doca_comch_client_create(this.dev, server_c.as_ptr(), &mut this.client),
            )?;
            check(
                "doca_comch_client_set_max_msg_size",
                sys::doca_comch_client_set_max_msg_size(this.client, super::MAX_BODY + 16),
            )?;
            let ctx = sys::doca_comch_client_as_ctx(this.client);
            check(
                "doca_pe_connect_ctx",
                sys::doca_pe_connect_ctx(this.pe, ctx),
            )?;
            check(
                "doca_comch_client_task_send_set_conf",
                sys::doca_comch_client_task_send_set_conf(
                    this.client,
                    Some(on_sent),
                    Some(on_sent),
                    16,
                ),
            )?;
            check(
                "doca_comch_client_event_msg_recv_register",
                sys::doca_comch_client_event_msg_recv_register(this.client, Some(on_message)),
            )?;
            check("doca_ctx_start", sys::doca_ctx_start(ctx))?;
            let deadline = Instant::now() + timeout;
            let mut state = sys::DOCA_CTX_STATE_STARTING;
            while state != sys::DOCA_CTX_STATE_RUNNING {
                if Instant::now() > deadline {
                    return Err(ControlError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("Comch server {server_name} did not accept within {timeout:?}"),
                    )));
                }
                progress(this.pe, &mut this.inbox);
                check(
                    "doca_ctx_get_state",
                    sys::doca_ctx_get_state(ctx, &mut state),
                )?;
            }
            check(
                "doca_comch_client_get_connection",
                sys::doca_comch_client_get_connection(this.client, &mut this.connection),
            )?;
        }
        match this.request(Request::Hello {
            role,
            name: name.to_owned(),
        })? {
            Response::Hello { .. } => Ok(this),
            other => Err(ControlError::Body(format!(
                "unexpected answer to Hello: {other:?}"
            ))),
        }
    }

    /// Sends a request and progresses until its answer arrives (keeping what the
    /// server pushes meanwhile: [`Self::take_pushes`]).
    pub fn request(&mut self, request: Request) -> Result<Response, ControlError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        self.submit(&encode(&Frame::Request(id, request)))?;
        loop {
            while let Some((bytes, _)) = self.inbox.messages.pop_front() {
                match decode(&bytes)? {
                    Frame::Response(got, response) if got == id => {
                        return match response {
                            Response::Error { code, message } => {
                                Err(ControlError::Refused { code, message })
                            }
                            r => Ok(r),
                        };
                    }
                    Frame::Response(0, Response::Teardown { reason }) => {
                        return Err(ControlError::Refused {
                            code: ErrorCode::Internal,
                            message: format!("torn down: {reason}"),
                        });
                    }
                    Frame::Response(0, push) => self.pushed.push_back(push),
                    _ => {}
                }
            }
            progress(self.pe, &mut self.inbox);
        }
    }

    /// Sends a request that is not answered (a doorbell).
    pub fn notify(&mut self, request: Request) -> Result<(), ControlError> {
        self.submit(&encode(&Frame::Request(0, request)))
    }

    /// Progresses once, keeping what the server pushed; whether anything happened.
    pub fn poll(&mut self) -> Result<bool, ControlError> {
        let progressed = progress(self.pe, &mut self.inbox);
        while let Some((bytes, _)) = self.inbox.messages.pop_front() {
            if let Frame::Response(0, push) = decode(&bytes)? {
                self.pushed.push_back(push);
            }
        }
        Ok(progressed)
    }

    /// What the server pushed since the last call.
    pub fn take_pushes(&mut self) -> Vec<Response> {
        self.pushed.drain(..).collect()
    }

    /// Hands one message to Comch (it copies it at submit).
    fn submit(&mut self, bytes: &[u8]) -> Result<(), ControlError> {
        let mut task = ptr::null_mut();
        // SAFETY: live client and connection; Comch copies the message at submit.
        unsafe {
            check(
                "doca_comch_client_task_send_alloc_init",
                sys::doca_comch_client_task_send_alloc_init(
                    self.client,
                    self.connection,
                    bytes.as_ptr().cast(),
                    bytes.len() as u32,
                    &mut task,
                ),
            )?;
            let t = sys::doca_comch_task_send_as_task(task);
            let submitted = sys::doca_task_submit(t);
            if submitted != sys::DOCA_SUCCESS {
                sys::doca_task_free(t);
                return Err(doca_err("doca_task_submit", submitted));
            }
        }
        Ok(())
    }
}

impl Drop for ComchClient {
    fn drop(&mut self) {
        // SAFETY: our handles, freed once in reverse order.
        unsafe {
            if !self.client.is_null() {
                sys::doca_ctx_stop(sys::doca_comch_client_as_ctx(self.client));
                sys::doca_comch_client_destroy(self.client);
            }
            if !self.pe.is_null() {
                sys::doca_pe_destroy(self.pe);
            }
            if !self.dev.is_null() {
                sys::doca_dev_close(self.dev);
            }
        }
    }
}

/// The DPU side: a Comch server answering with a [`Handler`], as the socket server
/// does.
pub struct ComchServer {
    dev: *mut sys::doca_dev,
    rep: *mut sys::doca_dev_rep,
    pe: *mut sys::doca_pe,
    server: *mut sys::doca_comch_server,
    handler: Arc<dyn Handler>,
    inbox: Inbox,
    peers: Vec<(*mut sys::doca_comch_connection, Option<Peer>)>,
    next_peer: u64,
    /// Store answers given later, on other threads: (connection, request id, answer),
    /// sent by the progress loop (the only thread that touches Comch).
    deferred: (
        crossbeam_channel::Sender<Deferred>,
        crossbeam_channel::Receiver<Deferred>,
    ),
}

/// A store answer for a connection (its address), to a request id.
type Deferred = (usize, u32, Response);

impl std::fmt::Debug for ComchServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComchServer").finish_non_exhaustive()
    }
}

impl ComchServer {
    /// Starts server `name` on the DPU device at `pci`, for the host function whose
    /// representor is at `rep_pci`.
    pub fn start(
        pci: &str,
        rep_pci: &str,
        name: &str,
        handler: Arc<dyn Handler>,
    ) -> Result<Self, ControlError> {
        let dev = open_device(pci)?;
        let name_c =
            CString::new(name).map_err(|_| ControlError::Body("bad server name".into()))?;
        let rep_c = CString::new(rep_pci)
            .map_err(|_| ControlError::Body("bad representor address".into()))?;
        let mut this = Self {
            dev,
            rep: ptr::null_mut(),
            pe: ptr::null_mut(),
            server: ptr::null_mut(),
            handler,
            inbox: Inbox::default(),
            peers: Vec::new(),
            next_peer: 1,
            deferred: crossbeam_channel::unbounded(),
        };
        // SAFETY: handles created here are freed by Drop on every path.
        unsafe {
            let mut reps = ptr::null_mut();
            let mut count = 0u32;
            check(
                "doca_devinfo_rep_create_list",
                sys::doca_devinfo_rep_create_list(
                    this.dev,
                    sys::DOCA_DEVINFO_REP_FILTER_NET,
                    &mut reps,
                    &mut count,
                ),
            )?;
            for i in 0..count as usize {
                let info = *reps.add(i);
                let mut equal = 0u8;
                if sys::doca_devinfo_rep_is_equal_pci_addr(info, rep_c.as_ptr(), &mut equal)
                    == sys::DOCA_SUCCESS
                    && equal == 1
                {
                    let opened = sys::doca_dev_rep_open(info, &mut this.rep);
                    if opened != sys::DOCA_SUCCESS {
                        sys::doca_devinfo_rep_destroy_list(reps);
                        return Err(doca_err("doca_dev_rep_open", opened));
                    }
                    break;
                }
            }
            sys::doca_devinfo_rep_destroy_list(reps);
            if this.rep.is_null() {
                return Err(ControlError::Io(std::io::Error::other(format!(
                    "no representor at PCI address {rep_pci}"
                ))));
            }
            check("doca_pe_create", sys::doca_pe_create(&mut this.pe))?;
            check(
                "doca_comch_server_create",
                sys::doca_comch_server_create(
                    this.dev,
                    this.rep,
                    name_c.as_ptr(),
                    &mut this.server,
                ),
            )?;
            check(
                "doca_comch_server_set_max_msg_size",
                sys::doca_comch_server_set_max_msg_size(this.server, super::MAX_BODY + 16),
            )?;
            let ctx = sys::doca_comch_server_as_ctx(this.server);
            check(
                "doca_pe_connect_ctx",
                sys::doca_pe_connect_ctx(this.pe, ctx),
            )?;
            check(
                "doca_comch_server_task_send_set_conf",
                sys::doca_comch_server_task_send_set_conf(
                    this.server,
                    Some(on_sent),
                    Some(on_sent),
                    64,
                ),
            )?;
            check(
                "doca_comch_server_event_msg_recv_register",
                sys::doca_comch_server_event_msg_recv_register(this.server, Some(on_message)),
            )?;
            check(
                "doca_comch_server_event_connection_status_changed_register",
                sys::doca_comch_server_event_connection_status_changed_register(
                    this.server,
                    Some(on_connect),
                    Some(on_disconnect),
                ),
            )?;
            check("doca_ctx_start", sys::doca_ctx_start(ctx))?;
        }
        Ok(this)
    }

    /// Progresses for up to `timeout`, answering requests and reporting departures.
    pub fn serve_for(&mut self, timeout: Duration) -> Result<(), ControlError> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !progress(self.pe, &mut self.inbox) {
                std::thread::sleep(Duration::from_micros(50));
            }
            for c in std::mem::take(&mut self.inbox.connected) {
                self.peers.push((c, None));
            }
            for c in std::mem::take(&mut self.inbox.disconnected) {
                if let Some(i) = self.peers.iter().position(|(p, _)| *p == c)
                    && let (_, Some(peer)) = self.peers.remove(i)
                {
                    self.handler.disconnected(&peer);
                }
            }
            while let Ok((connection, id, response)) = self.deferred.1.try_recv() {
                // Still connected (a departed peer's late answer is dropped).
                if let Some((c, _)) = self.peers.iter().find(|(c, _)| *c as usize == connection) {
                    let c = *c;
                    self.send(c, &encode(&Frame::Response(id, response)))?;
                }
            }
            while let Some((bytes, connection)) = self.inbox.messages.pop_front() {
                let reply = match decode(&bytes) {
                    Ok(Frame::Request(id, Request::Store(message))) => {
                        self.store(connection, id, message);
                        None
                    }
                    Ok(Frame::Request(_, Request::Doorbell { lane })) => {
                        if let Some((_, Some(peer))) =
                            self.peers.iter().find(|(c, _)| *c == connection)
                        {
                            self.handler.doorbell(peer, lane);
                        }
                        None
                    }
                    Ok(Frame::Request(id, request)) => Some((id, self.answer(connection, request))),
                    Ok(Frame::Response(..)) => None,
                    Err(ControlError::Version { theirs, .. }) => {
                        self.send(connection, &super::encode_version_mismatch(theirs))?;
                        None
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "dropping a malformed Comch control message");
                        None
                    }
                };
                if let Some((id, response)) = reply {
                    self.send(connection, &encode(&Frame::Response(id, response)))?;
                }
            }
        }
        Ok(())
    }

    /// A store message: the agent answers when its transfers are done, through the
    /// deferred queue this loop drains.
    fn store(&mut self, connection: *mut sys::doca_comch_connection, id: u32, message: Vec<u8>) {
        let tx = self.deferred.0.clone();
        let at = connection as usize;
        let reply = super::transport::StoreReply::new(move |response| {
            let _ = tx.send((at, id, response));
        });
        match self.peers.iter().find(|(c, _)| *c == connection) {
            // No descriptors over Comch: a host buffer is a DOCA mmap export here.
            Some((_, Some(peer))) => self.handler.handle_store(peer, message, Vec::new(), reply),
            _ => reply.refuse(ErrorCode::BadRequest, "say Hello first"),
        }
    }

    fn answer(
        &mut self,
        connection: *mut sys::doca_comch_connection,
        request: Request,
    ) -> Response {
        let index = match self.peers.iter().position(|(c, _)| *c == connection) {
            Some(i) => i,
            None => {
                self.peers.push((connection, None));
                self.peers.len() - 1
            }
        };
        match (&self.peers[index].1, request) {
            (_, Request::Hello { role, name }) => {
                let id = self.next_peer;
                self.next_peer += 1;
                // Pushes go out from the progress loop, the only thread on Comch.
                let tx = self.deferred.0.clone();
                let at = connection as usize;
                self.peers[index].1 = Some(Peer {
                    id,
                    role,
                    name,
                    service: None,
                    identity: None,
                    push: super::transport::Pusher::new(move |r| tx.send((at, 0, r)).is_ok()),
                });
                Response::Hello {
                    node: self.handler.node_name(),
                }
            }
            (None, _) => Response::Error {
                code: ErrorCode::BadRequest,
                message: "say Hello first".into(),
            },
            (Some(peer), Request::Authenticate { service, token }) => {
                match self.handler.authenticate(peer, &service, token.as_deref()) {
                    Ok(()) => {
                        if let Some(peer) = self.peers[index].1.as_mut() {
                            peer.service = Some(service);
                        }
                        Response::Ok
                    }
                    Err(refusal) => refusal,
                }
            }
            (Some(peer), request) => {
                let registering = match &request {
                    Request::RegisterPod { service, .. } => Some(service.clone()),
                    _ => None,
                };
                let response = self.handler.handle(peer, request);
                // A connection that registered a pod acts for its service.
                if let (Some(service), Response::PodRegistered(_)) = (registering, &response)
                    && let Some(peer) = self.peers[index].1.as_mut()
                {
                    peer.service = Some(service);
                }
                response
            }
        }
    }

    fn send(
        &mut self,
        connection: *mut sys::doca_comch_connection,
        bytes: &[u8],
    ) -> Result<(), ControlError> {
        let mut task = ptr::null_mut();
        // SAFETY: live server and connection; Comch copies the message at submit.
        unsafe {
            check(
                "doca_comch_server_task_send_alloc_init",
                sys::doca_comch_server_task_send_alloc_init(
                    self.server,
                    connection,
                    bytes.as_ptr().cast(),
                    bytes.len() as u32,
                    &mut task,
                ),
            )?;
            let t = sys::doca_comch_task_send_as_task(task);
            let submitted = sys::doca_task_submit(t);
            if submitted != sys::DOCA_SUCCESS {
                sys::doca_task_free(t);
                return Err(doca_err("doca_task_submit", submitted));
            }
        }
        Ok(())
    }
}

impl Drop for ComchServer {
    fn drop(&mut self) {
        for (_, peer) in self.peers.drain(..) {
            if let Some(peer) = peer {
                self.handler.disconnected(&peer);
            }
        }
        // SAFETY: our handles, freed once in reverse order.
        unsafe {
            if !self.server.is_null() {
                sys::doca_ctx_stop(sys::doca_comch_server_as_ctx(self.server));
                sys::doca_comch_server_destroy(self.server);
            }
            if !self.pe.is_null() {
                sys::doca_pe_destroy(self.pe);
            }
            if !self.rep.is_null() {
                sys::doca_dev_rep_close(self.rep);
            }
            if !self.dev.is_null() {
                sys::doca_dev_close(self.dev);
            }
        }
    }
}
