//! Header edits with arbitrary names and values: accepted edits never produce a head
//! that holds CR/LF/NUL in a value or an invalid name; refused ones change nothing.
#![no_main]

use arbitrary::Arbitrary;
use dpumesh_head::RequestHead;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Edit {
    Set(String, String),
    Append(String, String),
    Remove(String),
    Received(String, String),
    Metadata(String, String),
}

fuzz_target!(|edits: Vec<Edit>| {
    let mut head = RequestHead::new("GET", "/");
    for edit in edits {
        let _ = match edit {
            Edit::Set(n, v) => head.set_header(&n, &v),
            Edit::Append(n, v) => head.append_header(&n, &v),
            Edit::Remove(n) => head.remove_header(&n),
            Edit::Received(n, v) => head.append_received(&n, &v),
            Edit::Metadata(k, v) => {
                head.set_metadata(&k, &v);
                Ok(())
            }
        };
    }
    for (_, value) in head.headers() {
        assert!(
            !value
                .as_bytes()
                .iter()
                .any(|b| matches!(b, b'\r' | b'\n' | 0))
        );
    }
});
