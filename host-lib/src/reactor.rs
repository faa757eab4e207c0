//! A pod's loop on a tokio reactor: one thread drives the node's rings and the
//! runtime's sockets, timers and tasks.
//!
//! A loop that serves futures doing socket I/O (a bridge forwarding to a local server,
//! a `tower` service calling out) otherwise needs two threads: the loop sleeping on
//! its ring's futex, and a runtime's worker sleeping in `epoll` for the sockets. Each
//! request then crosses between them twice, a wake-up and a context switch each way.
//! Here the loop sleeps where the runtime does: the pod's bell (an eventfd the node
//! rings when it pushes to the pod's rings, and every waker of the loop rings too) is
//! in the reactor's wait set beside the sockets. A waker that fires on this thread
//! (a socket's task finished what a handler's future awaits) notifies the loop's task
//! instead: no system call. Run [`drive`] with `block_on` on a current-thread
//! runtime; tasks spawned from the handlers' futures run on that same thread.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use dpumesh_rings::reactor_bell::ReactorBell;

use crate::datapath::DataPathTransport;
use crate::event_loop::EventLoop;
use crate::transport::TransportError;

/// The longest sleep: how soon `stop` is seen, and how late a wake-up that rang
/// nothing the reactor watches (a thread unpark while the node is away) is noticed.
const NAP: Duration = Duration::from_millis(50);

/// The bell the reactor watches, and the registration it came with.
struct Watched {
    registration: u32,
    bell: ReactorBell,
}

/// Turns `service_loop` until `stop`, sleeping in the runtime's reactor between
/// turns. Await it on a current-thread runtime (`Runtime::block_on`).
pub async fn drive(
    service_loop: &mut EventLoop<DataPathTransport>,
    stop: &AtomicBool,
) -> Result<(), TransportError> {
    let mut watched: Option<Watched> = None;
    let woken = Arc::new(tokio::sync::Notify::new());
    service_loop.transport().wake_locally(woken.clone());
    while !stop.load(Ordering::Relaxed) {
        if service_loop.turn(Some(Duration::ZERO))? > 0 {
            // Let the runtime's tasks run and its reactor look at the sockets (one
            // non-blocking `epoll_wait`) before the next turn: a busy loop batches
            // what it serves rather than sleeping between requests.
            tokio::task::yield_now().await;
            continue;
        }
        let wait = [
            service_loop.next_timer(),
            service_loop.transport().wait_limit(),
        ]
        .into_iter()
        .flatten()
        .fold(NAP, Duration::min);
        let transport = service_loop.transport();
        let registration = transport.reregistered();
        if watched
            .as_ref()
            .is_none_or(|w| w.registration != registration)
        {
            // A new registration brought a new bell (or the node is away: none).
            watched = match transport.bell_fd() {
                Some(fd) => Some(Watched {
                    registration,
                    bell: ReactorBell::new(fd).map_err(|e| {
                        TransportError::Other(format!("cannot watch the pod's bell: {e}"))
                    })?,
                }),
                None => None,
            };
        }
        let Some(w) = watched.as_ref() else {
            tokio::time::sleep(wait).await;
            continue;
        };
        if transport.sleep_begins() {
            transport.sleep_ends();
            continue;
        }
        // Rung, woken or timed out, the next turn looks (`sleep_ends` reads the
        // eventfd, so its next ring is a new edge).
        let mut rung = std::pin::pin!(w.bell.rung());
        let mut notified = std::pin::pin!(woken.notified());
        let mut nap = std::pin::pin!(tokio::time::sleep(wait));
        let rung = std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = rung.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            if notified.as_mut().poll(cx).is_ready() || nap.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            Poll::Pending
        })
        .await;
        service_loop.transport().sleep_ends();
        if let Err(e) = rung {
            return Err(TransportError::Other(format!(
                "the reactor cannot watch the pod's bell: {e}"
            )));
        }
    }
    Ok(())
}
