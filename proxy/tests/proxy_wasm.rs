//! A proxy-wasm plugin named in the policy file like any filter: its configuration
//! (a string as is, a map as JSON), in a chain with a component, hot-reloaded; keys
//! only plugins take are refused for components.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use dpumesh_proxy::{Options, Proxy};
use dpumesh_test_artifacts as artifacts;

fn request(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: api.test\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("read response");
    raw
}

fn write_config(dir: &std::path::Path, plugin: &str, extra: &str) {
    let text = format!(
        r#"listener: 127.0.0.1:0
admin: 127.0.0.1:0
workers: 1
cache_dir: cache
filters:
  pw:
    component: pw.wasm
    deadline: 250ms
{plugin}
  tagger:
    component: test.wasm
    deadline: 250ms
    config: {{request: [{{metadata_to_header: [wasm.my.flag, x-flag]}}]}}
{extra}
chains:
  api: [pw, tagger]
services:
  api: {{chain: api}}
routes:
  - {{service: api}}
"#
    );
    let tmp = dir.join("proxy.yaml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join("proxy.yaml")).unwrap();
}

#[test]
fn a_plugin_in_the_policy_file_runs_with_a_component_and_reloads() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(artifacts::PROXY_WASM_TEST, dir.path().join("pw.wasm")).unwrap();
    std::fs::copy(artifacts::TEST_FILTER, dir.path().join("test.wasm")).unwrap();
    write_config(
        dir.path(),
        "    config: {add_header: [x-pw, one], set_property: 'on', deny_prefix: /admin, deny_status: 401}",
        "",
    );
    let proxy = Proxy::start(&dir.path().join("proxy.yaml"), Options { watch: None })
        .expect("the proxy starts with a plugin in its chain");
    let addr = proxy.listener_addr().unwrap();
    // The admin API says which filter is which kind.
    let admin = proxy.admin_addr().unwrap();
    let mut stream = TcpStream::connect(admin).unwrap();
    write!(
        stream,
        "GET /filters HTTP/1.1\r\nhost: {admin}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut filters = String::new();
    stream.read_to_string(&mut filters).unwrap();
    assert!(
        filters.contains(r#""kind":"proxy-wasm 0.2.1""#),
        "{filters}"
    );
    assert!(filters.contains(r#""kind":"component""#), "{filters}");
    // The Rust component runs as a core instance; "core" says so only of components.
    assert!(
        filters.contains(r#""core":true"#) && filters.contains(r#""core":false"#),
        "{filters}"
    );
    let raw = request(addr, "/items");
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert!(
        raw.contains(r#"["x-pw","one"]"#),
        "the plugin's edit: {raw}"
    );
    assert!(
        raw.contains(r#"["x-flag","on"]"#),
        "its property, read by the component: {raw}"
    );
    let raw = request(addr, "/admin");
    assert!(raw.starts_with("HTTP/1.1 401"), "{raw}");
    assert!(raw.contains("denied /admin"), "{raw}");

    // A new plugin configuration is a reload like any other.
    write_config(dir.path(), "    config: {add_header: [x-pw, two]}", "");
    proxy.policy().reload().expect("reload");
    let raw = request(addr, "/items");
    assert!(raw.contains(r#"["x-pw","two"]"#), "{raw}");
    assert!(request(addr, "/admin").starts_with("HTTP/1.1 200"));

    // A plugin's string configuration arrives without JSON quotes: the test plugin
    // reads it as JSON and refuses what is not, naming the text it got.
    write_config(dir.path(), "    config: 'not json'", "");
    let e = proxy.policy().reload().unwrap_err().to_string();
    assert!(e.contains("bad configuration"), "{e}");

    // vm_config and root_id are for plugins only.
    write_config(
        dir.path(),
        "    config: {add_header: [x-pw, three]}\n    vm_config: fast\n    root_id: main",
        "    root_id: nope",
    );
    let e = proxy.policy().reload().unwrap_err().to_string();
    assert!(e.contains("filters.tagger"), "{e}");
    assert!(e.contains("for proxy-wasm plugins"), "{e}");
    write_config(
        dir.path(),
        "    config: {add_header: [x-pw, three]}\n    vm_config: fast\n    root_id: main",
        "",
    );
    proxy
        .policy()
        .reload()
        .expect("a plugin takes vm_config and root_id");
    assert!(request(addr, "/items").contains(r#"["x-pw","three"]"#));
}
