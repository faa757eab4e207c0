//! Requests parked by a filter for its HTTP calls: the calls handed to the callout
//! thread, their answers brought back to the runner that parked the request (this
//! shard's, or the pool worker's for an offloaded chain), and a parked request given
//! up when its exchange ends first.

use super::*;

impl<F: Fabric> Reactor<F> {
    /// A filter paused exchange `xid` under `park` and made `callouts`.
    pub(super) fn park(&mut self, xid: u32, park: u32, callouts: Vec<dpumesh_runtime::Callout>) {
        if let Some(exchange) = self.table.get_mut(xid) {
            exchange.park = Some(park);
        }
        for callout in callouts {
            self.call_out(xid, park, callout);
        }
    }

    /// Makes the calls the plugins' root contexts made (ticks, queue notifications,
    /// answers to earlier calls); their answers go back to the instance that made them.
    pub(super) fn root_calls(&mut self) {
        for (to, callout) in self.filters.chains.take_root_calls() {
            let token = callout.token;
            let inbox = self.filters.inbox_tx.clone();
            let bell = self.bell.clone();
            let back = move |reply: CalloutReply| {
                let _ = inbox.send(Inbox::RootCallout {
                    to,
                    token,
                    reply: Box::new(reply),
                });
                bell.ring();
            };
            self.submit_call(callout, Box::new(back));
        }
    }

    /// Hands one call to the callout thread; its answer comes back through the inbox.
    fn call_out(&mut self, xid: u32, park: u32, callout: dpumesh_runtime::Callout) {
        let token = callout.token;
        let inbox = self.filters.inbox_tx.clone();
        let bell = self.bell.clone();
        let back = move |reply: CalloutReply| {
            let _ = inbox.send(Inbox::Callout {
                xid,
                park,
                token,
                reply: Box::new(reply),
            });
            bell.ring();
        };
        self.submit_call(callout, Box::new(back));
    }

    /// Resolves a call's upstream and hands it to the callout thread (started by the
    /// first call); `back` gets the answer, through the inbox (never re-entering the
    /// chain that made the call).
    fn submit_call(&mut self, callout: dpumesh_runtime::Callout, back: crate::callout::Done) {
        let target = match self.callout_target(&callout.upstream) {
            Ok(target) => target,
            Err(reason) => {
                // Answered through the inbox too, so the chain never re-enters itself.
                back(CalloutReply::Failed { reason });
                return;
            }
        };
        if self.filters.callouts.is_none() {
            match (self.filters.start_callouts)() {
                Ok(callouts) => self.filters.callouts = Some(callouts),
                Err(e) => {
                    back(CalloutReply::Failed {
                        reason: format!("the callout thread cannot start: {e}"),
                    });
                    return;
                }
            }
        }
        metrics::counter!("dpumesh_filter_callouts_total", "upstream" => callout.upstream.clone())
            .increment(1);
        if let Some(callouts) = &self.filters.callouts {
            callouts.submit(target, callout, back);
        }
    }

    /// Where a call naming `upstream` goes: a configured upstream's address, or a node
    /// running the mesh service (this one first).
    fn callout_target(&mut self, upstream: &str) -> Result<Target, String> {
        let snapshot = self.filters.policy.snapshot();
        let config = &snapshot.config.config;
        if let Some(configured) = config.upstreams.get(upstream) {
            return Ok(Target::Upstream(configured.address.clone()));
        }
        if !config.services.contains_key(upstream) {
            return Err(format!(
                "no mesh service or configured upstream is named {upstream:?}"
            ));
        }
        let placed = self.topology.placement.get(upstream);
        let here = placed.is_none_or(|nodes| nodes.contains(&self.topology.node));
        if here {
            return Ok(Target::Mesh {
                node: self.self_addr,
                service: upstream.to_owned(),
            });
        }
        let node = self
            .pick_peer(upstream)
            .ok_or_else(|| format!("no node of the mesh runs service {upstream:?}"))?;
        Ok(Target::Mesh {
            node: self.topology.peers[&node],
            service: upstream.to_owned(),
        })
    }

    /// A call's answer: to the runner that parked the request, if it still waits.
    pub(super) fn callout_done(&mut self, xid: u32, park: u32, token: u32, reply: CalloutReply) {
        let Some(exchange) = self.table.get(xid) else {
            // Answered (timed out) meanwhile: the request was given up then.
            return;
        };
        if exchange.park != Some(park) {
            // Resumed by an earlier answer: this one has no request left to go to.
            return;
        }
        let Some(ticket) = exchange.ticket.clone() else {
            return;
        };
        if ticket.worker == SHARD_RUNNER {
            match self.filters.chains.resume(&ticket, park, token, &reply) {
                Some(done) => self.decided(xid, Ok(Box::new(done))),
                None => self.fail(xid, lost_parked()),
            }
            return;
        }
        let inbox = self.filters.inbox_tx.clone();
        let bell = self.bell.clone();
        let submitted =
            self.filters
                .policy
                .pool()
                .resume_with(ticket, park, token, reply, move |done| {
                    let done = match done {
                        Ok(Some(done)) => Ok(Box::new(done)),
                        // Not parked there any more: an earlier answer resumed it (its
                        // decision is on its way) or it was given up. Nothing to do.
                        Ok(None) => return,
                        Err(e) => Err(e),
                    };
                    let _ = inbox.send(Inbox::Decided { xid, done });
                    bell.ring();
                });
        if let Err(e) = submitted {
            self.fail(xid, pool_error(e));
        }
    }

    /// Gives up a parked request where it is parked and runs its response phase there
    /// (which ends the paused filter's context).
    pub(super) fn abandon_parked(&mut self, ticket: Ticket, park: u32, info: ResponseInfo) {
        if ticket.worker == SHARD_RUNNER {
            self.filters.chains.abandon(&ticket, park, &info);
        } else {
            let _ = self
                .filters
                .policy
                .pool()
                .abandon_with(ticket, park, info, |_| {});
        }
    }
}

fn lost_parked() -> ProxyError {
    ProxyError::new(
        ErrorKind::Internal,
        "the request paused for a filter's HTTP call is no longer parked (its filter instances were rebuilt)",
    )
}
