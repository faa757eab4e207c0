use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};
use proptest::prelude::*;

use super::*;

const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Certificates for `ids` from a fresh CA of trust domain `td` in `dir`.
fn issue(dir: &Path, td: &str, ids: &[SpiffeId]) -> Vec<Arc<MeshTls>> {
    ca::ensure(dir, td, ids, ca::LEAF_VALIDITY, false).unwrap();
    ids.iter()
        .map(|id| MeshTls::load(TlsFiles::in_dir(dir, id), td).unwrap())
        .collect()
}

fn node(name: &str) -> SpiffeId {
    SpiffeId::node("test.mesh", name).unwrap()
}

#[test]
fn a_ticket_travels_as_private_data_padded_or_not() {
    let t = Ticket::random().unwrap();
    let data = t.to_private_data();
    assert_eq!(Ticket::from_private_data(&data), Ok(t));
    // InfiniBand hands the listener all 56 bytes, zero-padded.
    let mut padded = [0u8; 56];
    padded[..PRIVATE_DATA_LEN].copy_from_slice(&data);
    assert_eq!(Ticket::from_private_data(&padded), Ok(t));
    assert_ne!(Ticket::random().unwrap(), t, "tickets are random");
}

#[test]
fn private_data_without_a_ticket_is_refused_with_the_reason() {
    let good = Ticket::random().unwrap().to_private_data();
    let why = |data: &[u8]| match Ticket::from_private_data(data) {
        Err(AdmissionError::Malformed(why)) => why,
        other => panic!("{other:?}"),
    };
    assert!(why(&[]).contains("0 bytes"));
    assert!(why(&good[..20]).contains("20 bytes"));
    let mut magic = good;
    magic[0] = b'X';
    assert!(why(&magic).contains("magic"));
    let mut version = good;
    version[4] = 9;
    assert!(why(&version).contains("version 9"));
    let mut trailing = good.to_vec();
    trailing.extend_from_slice(&[0, 0, 1]);
    assert!(why(&trailing).contains("padding"));
}

proptest! {
    #[test]
    fn any_private_data_is_read_or_refused_without_panic(
        data in proptest::collection::vec(any::<u8>(), 0..64)
    ) {
        let _ = Ticket::from_private_data(&data);
    }
}

#[test]
fn a_ticket_admits_once_from_its_address_before_it_expires() {
    let t0 = Instant::now();
    let mut book = TicketBook::default();
    let t = Ticket::random().unwrap();
    book.issue(t, node("n2"), LOCAL, t0);
    assert_eq!(
        book.redeem(t, LOCAL, t0 + Duration::from_secs(1)),
        Ok(node("n2"))
    );
    assert_eq!(
        book.redeem(t, LOCAL, t0 + Duration::from_secs(1)),
        Err(AdmissionError::Unknown),
        "a replayed ticket admits nobody"
    );
    assert_eq!(
        book.redeem(Ticket::random().unwrap(), LOCAL, t0),
        Err(AdmissionError::Unknown),
        "a ticket never issued admits nobody"
    );

    let late = Ticket::random().unwrap();
    book.issue(late, node("n2"), LOCAL, t0);
    assert_eq!(
        book.redeem(late, LOCAL, t0 + TICKET_LIFETIME + Duration::from_secs(2)),
        Err(AdmissionError::Expired(Duration::from_secs(2)))
    );

    let elsewhere = Ticket::random().unwrap();
    let other: IpAddr = "10.0.0.9".parse().unwrap();
    book.issue(elsewhere, node("n2"), LOCAL, t0);
    assert_eq!(
        book.redeem(elsewhere, other, t0),
        Err(AdmissionError::WrongAddress {
            issued_to: LOCAL,
            from: other
        }),
        "a ticket seen on the wire is worth nothing from another host"
    );
    assert_eq!(book.pending(), 0, "every try used its ticket up");

    // A dual-stack socket reports IPv4 peers as mapped IPv6 addresses.
    let mapped = Ticket::random().unwrap();
    book.issue(
        mapped,
        node("n2"),
        IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped()),
        t0,
    );
    assert_eq!(book.redeem(mapped, LOCAL, t0), Ok(node("n2")));
    let v6 = Ticket::random().unwrap();
    book.issue(v6, node("n2"), IpAddr::V6(Ipv6Addr::LOCALHOST), t0);
    assert!(matches!(
        book.redeem(v6, LOCAL, t0),
        Err(AdmissionError::WrongAddress { .. })
    ));
}

#[test]
fn the_book_stays_bounded_dropping_the_oldest_and_the_expired() {
    let t0 = Instant::now();
    let mut book = TicketBook::default();
    let first = Ticket::random().unwrap();
    book.issue(first, node("n2"), LOCAL, t0);
    let mut last = first;
    for i in 1..=MAX_PENDING {
        last = Ticket::random().unwrap();
        book.issue(
            last,
            node("n2"),
            LOCAL,
            t0 + Duration::from_millis(i as u64),
        );
    }
    assert_eq!(book.pending(), MAX_PENDING);
    assert_eq!(book.redeem(first, LOCAL, t0), Err(AdmissionError::Unknown));
    assert!(
        book.redeem(last, LOCAL, t0 + Duration::from_secs(1))
            .is_ok()
    );
    // Issuing after the lifetime sweeps the expired ones out.
    book.issue(
        Ticket::random().unwrap(),
        node("n2"),
        LOCAL,
        t0 + TICKET_LIFETIME + Duration::from_secs(1),
    );
    assert_eq!(book.pending(), 1);
}

#[test]
fn only_a_proven_node_or_ingress_gets_through_the_gate() {
    let dir = tempfile::tempdir().unwrap();
    let ids = [
        node("n1"),
        node("n2"),
        SpiffeId::ingress("test.mesh").unwrap(),
        SpiffeId::workload("test.mesh", "default", "users").unwrap(),
    ];
    let tls = issue(dir.path(), "test.mesh", &ids);
    let (listener_tls, node_tls, ingress_tls, workload_tls) = (&tls[0], &tls[1], &tls[2], &tls[3]);
    let gate = Gate::start(listener_tls.clone(), "127.0.0.1:0".parse().unwrap()).unwrap();

    // A peer that connects and says nothing delays nobody.
    let _silent = TcpStream::connect(gate.local_addr()).unwrap();

    let (ticket, listener_id) = admit(node_tls, gate.local_addr()).unwrap();
    assert_eq!(
        listener_id, ids[0],
        "the connecting side learns who listens"
    );
    let data = ticket.to_private_data();
    assert_eq!(gate.redeem(&data, LOCAL), Ok(ids[1].clone()));
    assert_eq!(gate.redeem(&data, LOCAL), Err(AdmissionError::Unknown));

    let (ticket, _) = admit(ingress_tls, gate.local_addr()).unwrap();
    assert_eq!(
        gate.redeem(&ticket.to_private_data(), LOCAL),
        Ok(ids[2].clone())
    );

    // A workload of the mesh does not open fabric links.
    let refused = admit(workload_tls, gate.local_addr()).unwrap_err();
    assert!(matches!(refused, AdmissionError::Refused(_)), "{refused}");

    // Neither does a node of another CA, even one naming the same trust domain.
    let other = tempfile::tempdir().unwrap();
    let stranger = issue(other.path(), "test.mesh", &[node("n9")]);
    let refused = admit(&stranger[0], gate.local_addr()).unwrap_err();
    assert!(refused.to_string().contains("gate at"), "{refused}");

    // Forged private data admits nobody.
    assert_eq!(
        gate.redeem(&Ticket([7; 16]).to_private_data(), LOCAL),
        Err(AdmissionError::Unknown)
    );
    assert_eq!(gate.book.lock().pending(), 0, "refused peers got no ticket");
    // The gate counts a refusal on its own thread, maybe after the client gave up.
    let refusals = || {
        listener_tls
            .stats
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for _ in 0..200 {
        if refusals() >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(refusals(), 2, "refused handshakes are counted");

    // A closed gate takes no one in.
    let addr = gate.local_addr();
    drop(gate);
    let mut closed = false;
    for _ in 0..100 {
        if admit(node_tls, addr).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(closed, "the gate still admits after it was dropped");
}
