use std::mem::offset_of;

use proptest::prelude::*;

use super::*;

fn addr(region: u16, offset: u64) -> BufAddr {
    BufAddr::new(region, offset).unwrap()
}

fn sample() -> Descriptor {
    Descriptor::request(Case::PodToPod, 7, 3, 11, Destination::Pod(42))
        .with_header(Buffer::new(addr(2, 0x1000), 310))
        .with_body(Buffer::new(addr(3, 0x20_0000), 8 << 20))
}

#[test]
fn the_layout_is_the_seed_struct_in_one_cache_line() {
    assert_eq!(std::mem::size_of::<RawDescriptor>(), 64);
    assert_eq!(offset_of!(RawDescriptor, version), 0);
    assert_eq!(offset_of!(RawDescriptor, flags), 2);
    assert_eq!(offset_of!(RawDescriptor, header_len), 4);
    assert_eq!(offset_of!(RawDescriptor, header_addr), 8);
    assert_eq!(offset_of!(RawDescriptor, body_addr), 16);
    assert_eq!(offset_of!(RawDescriptor, body_len), 24);
    assert_eq!(offset_of!(RawDescriptor, req_id), 28);
    assert_eq!(offset_of!(RawDescriptor, step_id), 32);
    assert_eq!(offset_of!(RawDescriptor, src_pod), 36);
    assert_eq!(offset_of!(RawDescriptor, dst), 40);
    assert_eq!(offset_of!(RawDescriptor, dst_port), 56);
    assert_eq!(offset_of!(RawDescriptor, status), 58);
    // Rings publish by writing the last word, whose high half is `valid`.
    assert_eq!(offset_of!(RawDescriptor, valid), 60);
}

#[test]
fn bytes_match_the_repr_c_layout_field_by_field() {
    let raw = sample().to_raw();
    let bytes = raw.to_bytes();
    assert_eq!(&bytes[0..2], &DESCRIPTOR_VERSION.to_le_bytes());
    assert_eq!(&bytes[8..16], &addr(2, 0x1000).bits().to_le_bytes());
    assert_eq!(&bytes[24..28], &(8u32 << 20).to_le_bytes());
    assert_eq!(&bytes[40..44], &42u32.to_le_bytes());
    assert_eq!(RawDescriptor::from_bytes(&bytes), raw);
    assert_eq!(RawDescriptor::from_words(&raw.to_words()), raw);
}

#[test]
fn round_trips_every_case_and_kind() {
    let external = Destination::External("10.0.0.7:8443".parse().unwrap());
    let v6 = Destination::External("[2001:db8::1]:80".parse().unwrap());
    let cases = [
        Descriptor::request(Case::HostToRemote, 1, 0, 5, external)
            .with_header(Buffer::new(addr(1, 64), 200))
            .with_body(Buffer::new(addr(4, 0), 0)),
        Descriptor::request(Case::HostToRemote, 1, 1, 5, v6),
        // Seed case 2: no header buffer, the body holds everything.
        Descriptor::request(Case::ExternalToHost, 9, 0, 0, Destination::Pod(3))
            .with_body(Buffer::new(addr(9, 4096), 1024)),
        sample(),
        Descriptor {
            kind: Kind {
                response: true,
                ..Kind::default()
            },
            status: 503,
            ..sample()
        },
        Descriptor {
            kind: Kind {
                completion: true,
                error: true,
                ..Kind::default()
            },
            status: DescriptorStatus::PoolExhausted as u16,
            ..sample()
        },
        // The lane rides in the flags' high byte.
        Descriptor {
            lane: 255,
            ..sample()
        },
    ];
    for d in cases {
        let back = Descriptor::decode(&d.encode(1)).unwrap();
        assert_eq!(back, d);
    }
}

#[test]
fn garbage_is_refused_with_the_reason() {
    let good = sample().to_raw();
    let check = |mutate: &dyn Fn(&mut RawDescriptor), want: &str| {
        let mut raw = good;
        raw.valid = 1;
        mutate(&mut raw);
        let err = Descriptor::from_raw(&raw).unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} should mention {want:?}");
    };
    check(&|r| r.valid = 0, "not valid");
    check(&|r| r.version = 2, "version 2 is not supported");
    check(
        &|r| {
            r.flags |= Flags::STREAM.0;
            r.status = 700;
        },
        "stream descriptor carries status 700",
    );
    check(&|r| r.flags &= !Flags::CASES, "exactly one of case");
    check(&|r| r.flags |= Flags::CASE_1.0, "exactly one of case");
    check(&|r| r.dst[7] = 1, "pod destination is malformed");
    check(&|r| r.dst = [0; 16], "pod destination is malformed");
    check(&|r| r.dst_port = 80, "carries no port");
    check(
        &|r| {
            r.flags &= !Flags::DST_POD.0;
            r.dst = [0; 16];
            r.dst_port = 80;
        },
        "no usable address",
    );
    check(
        &|r| {
            r.flags = Flags::CASE_3.0;
            r.dst = Ipv6Addr::LOCALHOST.octets();
            r.dst_port = 80;
        },
        "needs a pod destination",
    );
    check(
        &|r| r.flags = Flags::CASE_1.0 | Flags::DST_POD.0,
        "needs a external destination",
    );
    check(
        &|r| {
            r.header_addr = 0;
            r.header_len = 5;
        },
        "header length is 5 but there is no header buffer",
    );
    check(&|r| r.body_addr = 0x1234, "names region 0");
    check(
        &|r| {
            r.body_addr = addr(1, BufAddr::MAX_OFFSET - 2).bits();
            r.body_len = 10;
        },
        "runs past the end",
    );
    check(
        &|r| {
            r.flags |= Flags::ERROR.0;
            r.status = 999;
        },
        "unknown status code 999",
    );
    assert_eq!(
        Descriptor::decode(&[0u8; 63]).unwrap_err(),
        DescriptorError::Length(63)
    );
}

#[test]
fn stream_parts_say_which_part_they_are_and_nothing_else() {
    let part = |status| Descriptor {
        kind: Kind {
            response: true,
            stream: true,
            ..Kind::default()
        },
        status,
        ..sample()
    };
    for (status, expected) in [
        (200, StreamPart::Open),
        (0, StreamPart::Data),
        (1, StreamPart::End),
        (2, StreamPart::Abort),
        (3, StreamPart::Taken),
        (4, StreamPart::Stop),
        (StreamPart::OPEN_REQUEST, StreamPart::Open),
    ] {
        let d = part(status);
        let back = Descriptor::decode(&d.encode(1)).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.stream_part(), Some(expected));
    }
    // A status that names no part is refused.
    for bad in [6, 99, 600] {
        assert_eq!(
            Descriptor::decode(&part(bad).encode(1)),
            Err(DescriptorError::StreamStatus(bad))
        );
    }
    // A part's completion and a stream's cancel notice are no parts.
    let mut done = part(0);
    done.kind.completion = true;
    assert_eq!(
        Descriptor::decode(&done.encode(1)).unwrap().stream_part(),
        None
    );
    let mut cancel = done;
    cancel.kind.error = true;
    cancel.status = DescriptorStatus::Cancelled as u16;
    let back = Descriptor::decode(&cancel.encode(1)).unwrap();
    assert_eq!(back.error_status(), Some(DescriptorStatus::Cancelled));
    // A whole message is no part either.
    assert_eq!(sample().stream_part(), None);
}

#[test]
fn only_what_goes_back_is_addressed_to_pod_zero() {
    // A caller's `Taken` / `Stop` for an answer from outside the node travels in the
    // request's direction, to pod 0; so do nothing else's request-direction parts.
    let to_outside = |status| Descriptor {
        kind: Kind {
            stream: true,
            ..Kind::default()
        },
        status,
        ..Descriptor::request(Case::ExternalToHost, 7, 3, 11, Destination::Pod(0))
    };
    for ack in [StreamPart::Taken, StreamPart::Stop] {
        let d = to_outside(ack.code());
        assert_eq!(Descriptor::decode(&d.encode(1)).unwrap(), d);
    }
    for other in [StreamPart::Data.code(), StreamPart::OPEN_REQUEST] {
        assert_eq!(
            Descriptor::decode(&to_outside(other).encode(1)),
            Err(DescriptorError::PodDestination)
        );
    }
    let request = Descriptor::request(Case::ExternalToHost, 7, 3, 11, Destination::Pod(0));
    assert_eq!(
        Descriptor::decode(&request.encode(1)),
        Err(DescriptorError::PodDestination)
    );
}

#[test]
fn buffer_addresses_split_into_region_and_offset() {
    let a = addr(0xbeef, 0x1234_5678_9abc);
    assert_eq!(a.region(), 0xbeef);
    assert_eq!(a.offset(), 0x1234_5678_9abc);
    assert_eq!(a.offset_by(4).unwrap().offset(), 0x1234_5678_9ac0);
    assert!(
        BufAddr::new(0, 5).is_none(),
        "region 0 is reserved for null"
    );
    assert!(BufAddr::new(1, BufAddr::MAX_OFFSET + 1).is_none());
    assert_eq!(a.to_string(), "r48879+0x123456789abc");
}

proptest! {
    #[test]
    fn decoding_any_bytes_never_panics_and_accepted_ones_round_trip(bytes in proptest::collection::vec(any::<u8>(), 64)) {
        if let Ok(d) = Descriptor::decode(&bytes) {
            let valid = u32::from_le_bytes([bytes[60], bytes[61], bytes[62], bytes[63]]);
            prop_assert_eq!(Descriptor::decode(&d.encode(valid)).unwrap(), d);
        }
    }

    #[test]
    fn mangled_valid_descriptors_never_panic(flip in 0usize..512, seed in any::<u64>()) {
        let mut bytes = sample().encode(seed as u32 | 1);
        bytes[flip / 8] ^= 1 << (flip % 8);
        let _ = Descriptor::decode(&bytes);
    }
}
