//! `dpumesh.store`: the BlueCache client for Python (`dpumesh_host::store` underneath).
//! Buffers are registered with the node's agent; PUSH and PULL batches return a
//! `Transfer` to poll (`done()`) or wait for (`wait()`), with the interpreter released
//! while waiting.

use std::str::FromStr;

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_host::store::{Item, SegmentResult, StoreBuffer, StoreClient, Transfer};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

fn failed(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// A connection to a node's BlueCache agent.
#[pyclass(name = "StoreClient", module = "dpumesh._native", frozen)]
pub(crate) struct PyStoreClient(StoreClient);

/// A host buffer registered with the agent.
#[pyclass(name = "StoreBuffer", module = "dpumesh._native", frozen)]
pub(crate) struct PyStoreBuffer(StoreBuffer);

/// A PUSH or PULL batch under way.
#[pyclass(name = "Transfer", module = "dpumesh._native", frozen)]
pub(crate) struct PyTransfer(Mutex<Option<Transfer>>);

fn result_dict<'py>(py: Python<'py>, r: &SegmentResult) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("status", format!("{:?}", r.status))?;
    d.set_item("size", r.size)?;
    d.set_item("crc32", r.crc32)?;
    d.set_item("message", &r.message)?;
    Ok(d)
}

fn ok(r: &SegmentResult, key: &str) -> PyResult<()> {
    if r.status == dpumesh_store::protocol::Status::Ok {
        return Ok(());
    }
    Err(PyRuntimeError::new_err(format!(
        "{key}: {:?}: {}",
        r.status, r.message
    )))
}

#[pymethods]
impl PyStoreBuffer {
    fn __len__(&self) -> usize {
        self.0.len()
    }

    /// Writes `data` at `offset`.
    fn write(&self, offset: u64, data: &[u8]) -> PyResult<()> {
        self.0.write(offset, data).map_err(failed)
    }

    /// `length` bytes at `offset`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.0.read_vec(offset, length).map_err(failed)?;
        Ok(PyBytes::new(py, &bytes))
    }
}

#[pymethods]
impl PyTransfer {
    /// Whether it finished (`checkXfer`).
    fn done(&self) -> bool {
        self.0.lock().as_ref().is_none_or(Transfer::is_done)
    }

    /// Waits for it: one dict per item (`status`, `size`, `crc32`, `message`).
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let transfer = self
            .0
            .lock()
            .take()
            .ok_or_else(|| PyValueError::new_err("this transfer was already waited for"))?;
        let results = py.detach(|| transfer.wait()).map_err(failed)?;
        results.iter().map(|r| result_dict(py, r)).collect()
    }
}

impl PyStoreClient {
    fn batch(
        &self,
        items: Vec<(String, Py<PyStoreBuffer>, u64, u64)>,
        push: bool,
        py: Python<'_>,
    ) -> PyTransfer {
        let buffers: Vec<(String, StoreBuffer, u64, u64)> = items
            .into_iter()
            .map(|(k, b, o, l)| (k, b.get().0.clone(), o, l))
            .collect();
        let items: Vec<Item<'_>> = buffers
            .iter()
            .map(|(key, buffer, offset, len)| Item {
                key,
                buffer,
                offset: *offset,
                len: *len,
            })
            .collect();
        let transfer = py.detach(|| {
            if push {
                self.0.put_batch(&items)
            } else {
                self.0.get_batch(&items)
            }
        });
        PyTransfer(Mutex::new(Some(transfer)))
    }
}

#[pymethods]
impl PyStoreClient {
    /// Connects to the node's control channel (`unix:PATH` or `tcp:HOST:PORT`; a pod
    /// has it in `DPUMESH_CONTROL`), acting for `service` with its registration
    /// `token` (by default `DPUMESH_SERVICE` and `DPUMESH_TOKEN`, as a pod has them):
    /// the objects are that service's.
    #[new]
    #[pyo3(signature = (control, name = "python", service = None, token = None))]
    fn new(
        py: Python<'_>,
        control: &str,
        name: &str,
        service: Option<String>,
        token: Option<String>,
    ) -> PyResult<Self> {
        let endpoint = Endpoint::from_str(control)
            .map_err(|e| PyValueError::new_err(format!("control endpoint {control:?}: {e}")))?;
        py.detach(|| match &service {
            Some(service) => StoreClient::connect_as(&endpoint, name, service, token.as_deref()),
            None => StoreClient::connect(&endpoint, name),
        })
        .map(Self)
        .map_err(|e| PyRuntimeError::new_err(format!("cannot reach the node at {control}: {e}")))
    }

    /// A buffer of `size` bytes, registered with the agent.
    fn register(&self, py: Python<'_>, size: usize) -> PyResult<PyStoreBuffer> {
        py.detach(|| self.0.register(size))
            .map(PyStoreBuffer)
            .map_err(failed)
    }

    /// PUSH: `[(key, buffer, offset, length), ...]`, each range becoming its object.
    fn put_batch(
        &self,
        py: Python<'_>,
        items: Vec<(String, Py<PyStoreBuffer>, u64, u64)>,
    ) -> PyTransfer {
        self.batch(items, true, py)
    }

    /// PULL: `[(key, buffer, offset, room), ...]`, each object into its range.
    fn get_batch(
        &self,
        py: Python<'_>,
        items: Vec<(String, Py<PyStoreBuffer>, u64, u64)>,
    ) -> PyTransfer {
        self.batch(items, false, py)
    }

    /// Stores `data` as `key` (a buffer of its size, one PUSH); its CRC-32.
    fn put(&self, py: Python<'_>, key: &str, data: &[u8]) -> PyResult<u32> {
        py.detach(|| {
            let buffer = self.0.register(data.len()).map_err(failed)?;
            buffer.write(0, data).map_err(failed)?;
            let item = Item {
                key,
                buffer: &buffer,
                offset: 0,
                len: data.len() as u64,
            };
            let results = self.0.put_batch(&[item]).wait().map_err(failed)?;
            ok(&results[0], key)?;
            Ok(results[0].crc32)
        })
    }

    /// `key`'s bytes, or `None` when there is no such object.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let bytes = py.detach(|| -> PyResult<Option<Vec<u8>>> {
            let Some(info) = self.0.stat(&[key]).map_err(failed)?.remove(0) else {
                return Ok(None);
            };
            let buffer = self.0.register(info.size as usize).map_err(failed)?;
            let item = Item {
                key,
                buffer: &buffer,
                offset: 0,
                len: buffer.len() as u64,
            };
            let results = self.0.get_batch(&[item]).wait().map_err(failed)?;
            ok(&results[0], key)?;
            buffer
                .read_vec(0, results[0].size as usize)
                .map(Some)
                .map_err(failed)
        })?;
        Ok(bytes.map(|b| PyBytes::new(py, &b)))
    }

    /// `{key: (size, crc32) or None}`.
    fn stat<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Bound<'py, PyDict>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let infos = py.detach(|| self.0.stat(&refs)).map_err(failed)?;
        let d = PyDict::new(py);
        for (key, info) in keys.iter().zip(infos) {
            d.set_item(key, info.map(|i| (i.size, i.crc32)))?;
        }
        Ok(d)
    }

    /// Removes objects; per key whether it was there.
    fn delete(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<bool>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let results = py.detach(|| self.0.delete(&refs)).map_err(failed)?;
        Ok(results
            .iter()
            .map(|r| r.status == dpumesh_store::protocol::Status::Ok)
            .collect())
    }

    /// `[(key, size, crc32), ...]` of the objects whose keys start with `prefix`.
    #[pyo3(signature = (prefix = ""))]
    fn list(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<(String, u64, u32)>> {
        let objects = py.detach(|| self.0.list(prefix)).map_err(failed)?;
        Ok(objects
            .into_iter()
            .map(|o| (o.key, o.size, o.crc32))
            .collect())
    }
}
