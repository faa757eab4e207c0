//! A fair share of the ingress's request slots for each client address.
//!
//! Every request holds a slot from the moment its body starts to arrive until its
//! answer is written, so a client that uploads slowly (or never finishes) holds its
//! slots for up to `body_timeout` each. Without a share, one client's slow uploads
//! take every slot and everyone else waits or gets 503 (slowloris on the body). Here a
//! client address holds at most `slots_per_client` at once across all the ingress's
//! threads; past that its requests get 429 at once while the others are served.
//!
//! The count is one map behind a lock for the whole ingress (two short critical
//! sections per request): per-thread counts would refuse a client whose connections
//! the kernel happened to spread unevenly over the threads.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// Slots in use per client address.
#[derive(Debug)]
pub struct ClientShare {
    cap: u32,
    held: Mutex<HashMap<IpAddr, u32>>,
    /// Every client's together: `dpumesh_ingress_requests_in_flight`.
    in_flight: metrics::Gauge,
}

/// One slot's worth of a client's share, given back when dropped.
#[derive(Debug)]
pub struct Held {
    share: Arc<ClientShare>,
    client: IpAddr,
}

impl ClientShare {
    /// Each client address may hold `cap` slots (at least one).
    pub fn new(cap: u32) -> Arc<Self> {
        Arc::new(Self {
            cap: cap.max(1),
            held: Mutex::new(HashMap::new()),
            in_flight: metrics::gauge!("dpumesh_ingress_requests_in_flight"),
        })
    }

    /// Takes one more of `client`'s share, or says how many it holds already.
    pub fn take(self: &Arc<Self>, client: IpAddr) -> Result<Held, u32> {
        // A v4 client over a dual-stack socket is the same client as over v4.
        let client = client.to_canonical();
        let mut held = self.held.lock();
        let n = held.entry(client).or_insert(0);
        if *n >= self.cap {
            return Err(*n);
        }
        *n += 1;
        self.in_flight.increment(1.0);
        Ok(Held {
            share: self.clone(),
            client,
        })
    }

    /// Slots `client` holds now.
    pub fn held_by(&self, client: IpAddr) -> u32 {
        self.held
            .lock()
            .get(&client.to_canonical())
            .copied()
            .unwrap_or(0)
    }

    /// The most one client may hold.
    pub fn cap(&self) -> u32 {
        self.cap
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.share.in_flight.decrement(1.0);
        let mut held = self.share.held.lock();
        if let Some(n) = held.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                // No entry stays for a client that left: the map holds only those
                // with requests in flight.
                held.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_share_and_gets_it_back() {
        let share = ClientShare::new(2);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let first = share.take(a).unwrap();
        let _second = share.take(a).unwrap();
        assert_eq!(share.take(a).unwrap_err(), 2, "a's share is used up");
        // Another client is not affected.
        let _other = share.take(b).unwrap();
        drop(first);
        assert_eq!(share.held_by(a), 1);
        let _again = share.take(a).unwrap();
        // A v4-mapped v6 address is the same client.
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(share.take(mapped).unwrap_err(), 2);
    }

    #[test]
    fn no_entry_stays_for_a_client_with_nothing_in_flight() {
        let share = ClientShare::new(1);
        for i in 0..1000u32 {
            let client = IpAddr::from(i.to_be_bytes());
            drop(share.take(client).unwrap());
        }
        assert!(share.held.lock().is_empty());
        assert_eq!(ClientShare::new(0).cap(), 1);
    }
}
