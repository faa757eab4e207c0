use std::net::SocketAddr;

use super::*;
use crate::descriptor::{BufAddr, Buffer, Case, Destination};

fn desc(n: u32) -> Descriptor {
    Descriptor::request(Case::PodToPod, n, n % 7, 1, Destination::Pod(2))
        .with_body(Buffer::new(BufAddr::new(3, 64 * n as u64).unwrap(), n))
}

fn ring(capacity: u32) -> Ring {
    Ring::create_in_shm("dpumesh-test-ring", capacity).unwrap()
}

#[test]
fn descriptors_come_out_in_order_across_many_laps() {
    let r = ring(4);
    let (mut tx, mut rx) = (r.producer(), r.consumer());
    for n in 0..1000 {
        tx.push(&desc(n)).unwrap();
        if n % 3 == 2 {
            for m in n - 2..=n {
                assert_eq!(rx.try_pop().unwrap(), Some(desc(m)));
            }
        }
    }
    while let Some(d) = rx.try_pop().unwrap() {
        assert!(d.req_id >= 996);
    }
    assert_eq!(r.depth(), 0);
}

#[test]
fn a_full_ring_refuses_and_keeps_what_it_holds() {
    let r = ring(4);
    let (mut tx, mut rx) = (r.producer(), r.consumer());
    for n in 0..4 {
        tx.push(&desc(n)).unwrap();
    }
    assert_eq!(tx.free(), 0);
    let err = tx.push(&desc(99)).unwrap_err().to_string();
    assert!(err.contains("is full (4 descriptors in flight)"), "{err}");
    assert_eq!(r.depth(), 4);
    for n in 0..4 {
        assert_eq!(rx.try_pop().unwrap(), Some(desc(n)), "nothing overwritten");
    }
    assert_eq!(rx.try_pop().unwrap(), None);
    assert_eq!(
        tx.push_batch(&[desc(5), desc(6), desc(7), desc(8), desc(9)]),
        4
    );
}

#[test]
fn garbage_entries_are_reported_and_skipped() {
    let r = ring(8);
    let (mut tx, mut rx) = (r.producer(), r.consumer());
    let mut raw = desc(1).to_raw();
    raw.version = 9;
    tx.push_raw(&raw).unwrap();
    tx.push(&desc(2)).unwrap();
    let err = rx.try_pop().unwrap_err().to_string();
    assert!(
        err.contains("entry 0: descriptor version 9 is not supported"),
        "{err}"
    );
    assert_eq!(rx.try_pop().unwrap(), Some(desc(2)));
}

#[test]
fn an_external_destination_survives_the_ring() {
    let r = ring(2);
    let (mut tx, mut rx) = (r.producer(), r.consumer());
    let addr: SocketAddr = "192.0.2.10:9000".parse().unwrap();
    let d = Descriptor::request(Case::HostToRemote, 1, 2, 3, Destination::External(addr));
    tx.push(&d).unwrap();
    assert_eq!(rx.try_pop().unwrap(), Some(d));
}

#[test]
fn event_mode_sleeps_and_is_woken_by_the_producer() {
    let r = ring(16);
    let mut tx = r.producer();
    let mut rx = r.consumer();
    let consumer = std::thread::spawn(move || {
        let mut got = Vec::new();
        while got.len() < 200 {
            if let Some(d) = rx
                .pop_wait(
                    WakeMode::Event {
                        spin: Duration::ZERO,
                    },
                    Duration::from_secs(10),
                )
                .unwrap()
            {
                got.push(d.req_id);
            }
        }
        got
    });
    for n in 0..200 {
        while tx.push(&desc(n)).is_err() {
            std::thread::yield_now();
        }
        if n % 50 == 0 {
            // Let the consumer fall asleep so the futex path is taken.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(
        dpumesh_test_support::joined(consumer),
        (0..200).collect::<Vec<_>>()
    );
}

#[test]
fn one_sleeper_is_woken_by_any_of_its_lanes() {
    // A pod's RX lanes: lane 1's producer wakes through lane 0's words, and the pod
    // sleeps on lane 0's futex for both.
    let (lane0, lane1) = (ring(16), ring(16));
    let mut tx0 = lane0.producer();
    let mut tx1 = lane1.producer().wakes_through(lane0.clone());
    let mut rx0 = lane0.consumer();
    let others = [lane1.consumer()];
    let consumer = std::thread::spawn(move || {
        let mut others = others;
        let mut got = Vec::new();
        let sleep = WakeMode::Event {
            spin: Duration::ZERO,
        };
        while got.len() < 100 {
            // A lost wake-up shows as a 10 s wait that ends with nothing.
            assert!(
                rx0.wait_any(&others, sleep, Duration::from_secs(10)),
                "woken with nothing after {got:?}"
            );
            while let Some(d) = rx0.try_pop().unwrap() {
                got.push(d.req_id);
            }
            while let Some(d) = others[0].try_pop().unwrap() {
                got.push(d.req_id);
            }
        }
        got.sort_unstable();
        got
    });
    for n in 0..100 {
        let tx = if n % 3 == 0 { &mut tx0 } else { &mut tx1 };
        while tx.push(&desc(n)).is_err() {
            std::thread::yield_now();
        }
        if n % 10 == 0 {
            // Let the consumer fall asleep so the futex path is taken.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(
        dpumesh_test_support::joined(consumer),
        (0..100).collect::<Vec<_>>()
    );
}

#[test]
fn waiting_on_an_empty_ring_times_out() {
    let r = ring(2);
    let mut rx = r.consumer();
    for mode in [WakeMode::Poll, WakeMode::LOW_CPU] {
        let started = Instant::now();
        assert_eq!(rx.pop_wait(mode, Duration::from_millis(20)).unwrap(), None);
        assert!(started.elapsed() >= Duration::from_millis(20));
    }
}

#[test]
fn a_consumer_position_past_the_producer_counts_as_full_not_as_room() {
    let r = ring(4);
    let mut tx = r.producer();
    tx.push(&desc(1)).unwrap();
    // Another process scribbles a head beyond the tail.
    r.region().atomic_u64s(HEAD, 1).unwrap()[0].store(1000, Ordering::Release);
    assert_eq!(tx.free(), 0);
    assert!(matches!(tx.push(&desc(2)), Err(RingError::Full { .. })));
}

#[test]
fn bad_capacities_and_foreign_regions_are_refused() {
    for c in [0, 3, 1, 1 << 25] {
        assert!(matches!(
            Ring::create_in_shm("dpumesh-test-ring", c),
            Err(RingError::Capacity(_))
        ));
    }
    let region = Arc::new(SharedRegion::create_unique("dpumesh-test-ring", 4096).unwrap());
    assert!(matches!(
        Ring::attach(region),
        Err(RingError::NotARing { .. })
    ));
}

#[test]
fn entry_ranges_split_where_the_ring_wraps() {
    let r = ring(8);
    let size = DESCRIPTOR_SIZE as u64;
    assert_eq!(
        r.entry_ranges(2, 3),
        [(ENTRIES + 2 * size, 3 * size), (ENTRIES, 0)]
    );
    // Positions 14, 15 are slots 6, 7; 16, 17 wrap to 0, 1.
    assert_eq!(
        r.entry_ranges(14, 4),
        [(ENTRIES + 6 * size, 2 * size), (ENTRIES, 2 * size)]
    );
    // Never more than the ring.
    assert_eq!(r.entry_ranges(0, 100), [(ENTRIES, 8 * size), (ENTRIES, 0)]);
}
