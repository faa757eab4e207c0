//! `dpumesh.StepResult`: a step's result as Python sees it (the Rust [`StepResult`],
//! read lazily: the body is decoded only when asked for).

use bytes::Bytes;
use dpumesh_host::{StepError, StepResult};
use http::{HeaderMap, HeaderName, HeaderValue};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// The result of a step: `status_code`, `headers`, `body` (text), `content` (bytes),
/// `error` (why it failed, or `None`), `ok`, `skipped`, and `parts` for a fan-out.
#[pyclass(frozen, name = "StepResult", module = "dpumesh")]
pub struct PyStepResult {
    pub(crate) inner: StepResult,
}

impl PyStepResult {
    pub(crate) fn new(inner: StepResult) -> Self {
        Self { inner }
    }
}

/// Header pairs into a map, refusing names or values HTTP does not allow.
pub(crate) fn header_map(pairs: &[(String, String)], whose: &str) -> PyResult<HeaderMap> {
    let mut map = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        let name = HeaderName::try_from(name.as_str())
            .map_err(|_| PyValueError::new_err(format!("{whose}: invalid header name {name:?}")))?;
        let value = HeaderValue::try_from(value.as_str()).map_err(|_| {
            PyValueError::new_err(format!("{whose}: invalid value for header {name}"))
        })?;
        map.append(name, value);
    }
    Ok(map)
}

/// Bytes from a `str` (UTF-8) or any bytes-like object.
pub(crate) fn body_bytes(body: Option<&Bound<'_, PyAny>>) -> PyResult<Bytes> {
    match body {
        None => Ok(Bytes::new()),
        Some(b) if b.is_none() => Ok(Bytes::new()),
        Some(b) => {
            if let Ok(s) = b.extract::<String>() {
                Ok(Bytes::from(s))
            } else {
                Ok(Bytes::from(b.extract::<Vec<u8>>()?))
            }
        }
    }
}

/// A header value as text: UTF-8 when it is, else its bytes as Latin-1 (as WSGI does).
pub(crate) fn header_text(value: &HeaderValue) -> String {
    match value.to_str() {
        Ok(s) => s.to_owned(),
        Err(_) => value.as_bytes().iter().map(|&b| b as char).collect(),
    }
}

#[pymethods]
impl PyStepResult {
    /// A result built by hand (tests; an internal step may return one).
    #[new]
    #[pyo3(signature = (id, status_code = 200, body = None, headers = None, error = None))]
    fn py_new(
        id: String,
        status_code: u16,
        body: Option<&Bound<'_, PyAny>>,
        headers: Option<Vec<(String, String)>>,
        error: Option<String>,
    ) -> PyResult<Self> {
        let headers = header_map(&headers.unwrap_or_default(), "StepResult")?;
        let body = body_bytes(body)?;
        let inner = match error {
            None => StepResult::success(id, status_code, headers, body),
            Some(e) => StepResult {
                status: status_code,
                headers,
                body,
                ..StepResult::failure(id, StepError::Failed(e))
            },
        };
        Ok(Self { inner })
    }

    /// The step's id.
    #[getter]
    fn id(&self) -> &str {
        &self.inner.id
    }

    /// The status: the answer's for a call, 200 (or what the function said) for an
    /// internal step, the error's for a failure.
    #[getter]
    fn status_code(&self) -> u16 {
        self.inner.status
    }

    /// Whether the step succeeded.
    #[getter]
    fn ok(&self) -> bool {
        self.inner.ok
    }

    /// Whether the step had nothing to do (its request builder returned `[]`).
    #[getter]
    fn skipped(&self) -> bool {
        self.inner.skipped
    }

    /// Why the step failed (`None` when it did not).
    #[getter]
    fn error(&self) -> Option<String> {
        self.inner.error.as_ref().map(ToString::to_string)
    }

    /// The body as text (UTF-8; invalid bytes replaced).
    #[getter]
    fn body(&self) -> String {
        String::from_utf8_lossy(&self.inner.body).into_owned()
    }

    /// The body as text (same as `body`).
    #[getter]
    fn text(&self) -> String {
        self.body()
    }

    /// The body's bytes.
    #[getter]
    fn content<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.body)
    }

    /// The headers, names in lower case; repeated headers joined with `, `.
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for name in self.inner.headers.keys() {
            let joined = self
                .inner
                .headers
                .get_all(name)
                .iter()
                .map(header_text)
                .collect::<Vec<_>>()
                .join(", ");
            dict.set_item(name.as_str(), joined)?;
        }
        Ok(dict)
    }

    /// Per-request results of a fan-out step (empty otherwise).
    #[getter]
    fn parts(&self) -> Vec<PyStepResult> {
        self.inner
            .parts
            .iter()
            .map(|p| PyStepResult::new(p.clone()))
            .collect()
    }

    /// The body parsed as JSON.
    fn json<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("json")?
            .call_method1("loads", (PyBytes::new(py, &self.inner.body),))
    }

    fn __repr__(&self) -> String {
        let r = &self.inner;
        match &r.error {
            Some(e) => format!(
                "StepResult({:?}, status_code={}, error={:?})",
                r.id,
                r.status,
                e.to_string()
            ),
            None if r.skipped => format!("StepResult({:?}, skipped)", r.id),
            None => format!(
                "StepResult({:?}, status_code={}, {} bytes)",
                r.id,
                r.status,
                r.body.len()
            ),
        }
    }
}
