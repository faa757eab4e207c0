//! The BlueField split in software (docs/data-path.md, "On a BlueField"): `dpumesh up`
//! with `DPUMESH_DATA_PATH=split` runs each node as a DPU would run, touching its
//! pods' rings and pools only through its DMA engine, and a host agent (`dpumesh
//! host`) per node where the hotel's pods register unchanged. Every case crosses it:
//! the ingress's bodies land in a pod's host memory (case 2), the frontend calls a
//! service on its node (case 3) and one on the other node (case 1).

mod common;
use common::mesh::*;
use common::token;

#[test]
fn the_hotel_runs_unchanged_through_host_agents_and_nodes_that_reach_it_only_by_dma() {
    let dir = tempfile::tempdir().unwrap();
    let (file, ingress) = mesh_files(dir.path(), |m| m);
    let mesh = Mesh::start_env(dir, &file, ingress, &[("DPUMESH_DATA_PATH", "split")]);
    let up = mesh.child.id().to_string();
    assert_eq!(pids_of(&up, "dpumesh node").len(), 2);
    assert_eq!(
        pids_of(&up, "dpumesh host").len(),
        2,
        "a host agent per node"
    );
    let alice = token("alice", &["user"]);

    // The frontend calls user (its node: case 3) and reservation (the other: case 1).
    let (status, _, body) = mesh.get("/hotels?user=7", Some(&alice));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["user"]["name"], "guest-7");
    assert_eq!(v["reservations"][0]["hotel"], "harbour-view");

    // The chain still decides on the DPU side.
    assert_eq!(mesh.get("/hotels?user=7", None).0, 401);

    // Bodies from the ingress into the pod's host memory and back, intact.
    for len in [0usize, 1024, 8 << 20] {
        let sent: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let (status, headers, got) = mesh.post("/echo", &alice, &sent);
        assert_eq!(status, 200, "{len} B");
        assert_eq!(
            header(&headers, "x-crc32"),
            Some(crc32fast::hash(&sent).to_string().as_str()),
            "{len} B"
        );
        let mut want = sent.clone();
        want.reverse();
        assert!(got == want, "{len} B came back intact");
    }

    // Streamed bodies both ways between the ingress and a pod across PCIe: parts
    // through the node's staging copies of the pod's pools.
    let (status, _, body) = mesh.get("/download?bytes=3000000", Some(&alice));
    assert_eq!(status, 200);
    assert_eq!(body.len(), 3_000_000);
    assert!(
        body.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8),
        "the download's pattern"
    );
    let sent: Vec<u8> = (0..3_000_000usize).map(|i| (i * 13) as u8).collect();
    let (status, _, body) = mesh.post("/upload", &alice, &sent);
    assert_eq!(status, 200);
    assert_eq!(
        String::from_utf8_lossy(&body),
        format!("bytes=3000000 crc32={:08x}\n", crc32fast::hash(&sent))
    );
}
