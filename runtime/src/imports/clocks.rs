//! `wasi:clocks/monotonic-clock` as a filter gets it: the node's clock (a test clock
//! fixes it), and subscriptions that are ready at once.
//!
//! A filter runs on a thread that serves many requests. WASI lets a guest sleep
//! (`subscribe-duration` then `pollable.block`, or `wasi:io/poll.poll`), and a sleeping
//! guest spends no CPU, so the CPU deadline would never end it: the thread, and every
//! request behind it, would wait. Here every clock subscription is ready when made,
//! so a sleep returns at once; a guest that loops until some time has passed spins,
//! and spinning is what the CPU deadline stops. wasmtime's own WASI is linked first
//! and this interface is defined again over it (shadowing).

use std::future::Future;
use std::pin::Pin;

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::clocks::monotonic_clock;
use wasmtime_wasi::p2::{DynPollable, Pollable};

use crate::imports::StoreState;

/// A pollable that is always ready.
struct Ready;

impl Pollable for Ready {
    // `async fn ready(&mut self) {}` as the `async_trait` the trait is declared with
    // would write it.
    fn ready<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(std::future::ready(()))
    }
}

/// What the interface's functions see of the store.
pub(crate) struct NoSleepView<'a> {
    clock: &'a dpumesh_clock::SharedClock,
    table: &'a mut ResourceTable,
}

struct NoSleep;

impl HasData for NoSleep {
    type Data<'a> = NoSleepView<'a>;
}

fn ready(table: &mut ResourceTable) -> wasmtime::Result<Resource<DynPollable>> {
    let ready = table.push(Ready)?;
    wasmtime_wasi::p2::subscribe(table, ready)
}

impl monotonic_clock::Host for NoSleepView<'_> {
    fn now(&mut self) -> wasmtime::Result<monotonic_clock::Instant> {
        Ok(self.clock.monotonic_ns())
    }

    fn resolution(&mut self) -> wasmtime::Result<monotonic_clock::Duration> {
        Ok(1)
    }

    fn subscribe_instant(
        &mut self,
        _when: monotonic_clock::Instant,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        ready(self.table)
    }

    fn subscribe_duration(
        &mut self,
        _duration: monotonic_clock::Duration,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        ready(self.table)
    }
}

/// Defines the interface again over wasmtime's (which `linker` already holds).
pub(crate) fn shadow(linker: &mut Linker<StoreState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let defined =
        monotonic_clock::add_to_linker::<StoreState, NoSleep>(linker, |state| NoSleepView {
            clock: &state.services.clock,
            table: &mut state.wasi.table,
        });
    linker.allow_shadowing(false);
    defined
}
