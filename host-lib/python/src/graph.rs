//! Python graph steps (`dpumesh.graph`: checked when the handler built them) into the
//! Rust library's steps, whose leaves call back into Python: an internal step on the
//! pool's thread, a request builder on the loop's, each attached to the interpreter
//! only for the call.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dpumesh_host::{EgressStep, HttpRequest, Inputs, InternalStep, Step, StepOutput, order, pipe};
use http::Method;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::{PyTypeInfo, intern};

use crate::result::{PyStepResult, header_map};

/// The Python functions steps call (`dpumesh._steps`).
pub(crate) struct Helpers {
    run_internal: Py<PyAny>,
    build_requests: Py<PyAny>,
}

impl Helpers {
    pub(crate) fn load(py: Python<'_>) -> PyResult<Arc<Self>> {
        let steps = py.import("dpumesh._steps")?;
        Ok(Arc::new(Self {
            run_internal: steps.getattr("run_internal")?.unbind(),
            build_requests: steps.getattr("build_requests")?.unbind(),
        }))
    }
}

/// A Python exception as a step's error text: `TypeError: what went wrong`.
pub(crate) fn error_text(py: Python<'_>, e: &PyErr) -> String {
    let kind = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".to_owned());
    match e.value(py).str() {
        Ok(msg) if !msg.to_string_lossy().is_empty() => {
            format!("{kind}: {}", msg.to_string_lossy())
        }
        _ => kind,
    }
}

/// The results of `ids` as a dict, in that order (absent ones left out).
fn inputs_dict<'py>(
    py: Python<'py>,
    ids: &[String],
    inputs: &Inputs,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for id in ids {
        if let Some(result) = inputs.get(id) {
            dict.set_item(id, Bound::new(py, PyStepResult::new(result.clone()))?)?;
        }
    }
    Ok(dict)
}

/// A checked request tuple `(method, url, [(name, value)], bytes)` as a request.
fn request(item: &Bound<'_, PyAny>, step: &str) -> PyResult<HttpRequest> {
    let (method, url, headers, body): (String, String, Vec<(String, String)>, Bound<'_, PyAny>) =
        item.extract()?;
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| PyValueError::new_err(format!("step {step:?}: invalid method {method:?}")))?;
    let body = body.cast::<PyBytes>()?;
    Ok(HttpRequest {
        method,
        url,
        headers: header_map(&headers, &format!("step {step:?}"))?,
        body: Bytes::copy_from_slice(body.as_bytes()),
        trailers: Default::default(),
        caller: None,
        stream: None,
    })
}

fn seconds(timeout: Option<f64>) -> Option<Duration> {
    timeout.and_then(|s| Duration::try_from_secs_f64(s).ok())
}

/// A Python step (`Order`, `Pipe`, `EgressStep`, `InternalStep`) as a Rust step.
pub(crate) fn node(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    helpers: &Arc<Helpers>,
) -> PyResult<Step> {
    let kind = obj.getattr(intern!(py, "_kind"))?;
    let kind = kind.extract::<&str>()?;
    match kind {
        "order" | "pipe" => {
            let steps = obj.getattr(intern!(py, "steps"))?;
            let steps = steps.cast::<PyList>()?;
            let children = steps
                .iter()
                .map(|s| node(py, &s, helpers))
                .collect::<PyResult<Vec<_>>>()?;
            Ok(if kind == "order" {
                order(children)
            } else {
                pipe(children)
            })
        }
        "egress" => egress(py, obj, helpers),
        "internal" => internal(py, obj, helpers),
        other => Err(PyValueError::new_err(format!(
            "{other:?} is not a kind of step"
        ))),
    }
}

fn egress(py: Python<'_>, obj: &Bound<'_, PyAny>, helpers: &Arc<Helpers>) -> PyResult<Step> {
    let id: String = obj.getattr(intern!(py, "id"))?.extract()?;
    let inputs: Vec<String> = obj.getattr(intern!(py, "inputs"))?.extract()?;
    let timeout: Option<f64> = obj.getattr(intern!(py, "timeout"))?.extract()?;
    let concurrent: bool = obj.getattr(intern!(py, "concurrent"))?.extract()?;
    let builder = obj.getattr(intern!(py, "request_builder"))?;
    let mut step = if builder.is_none() {
        let requests = obj.getattr(intern!(py, "requests"))?;
        let requests = requests
            .cast::<PyList>()?
            .iter()
            .map(|r| request(&r, &id))
            .collect::<PyResult<Vec<_>>>()?;
        let mut step = EgressStep::new(id, requests);
        step.inputs = inputs;
        step
    } else {
        let builder = builder.unbind();
        let helpers = helpers.clone();
        let (step_id, ids) = (id.clone(), inputs.clone());
        // Runs on the loop's thread when the step starts.
        EgressStep::try_built(id, inputs, move |results: &Inputs| {
            Python::attach(|py| {
                let built = inputs_dict(py, &ids, results)
                    .and_then(|dict| helpers.build_requests.call1(py, (&step_id, builder, dict)))
                    .and_then(|list| {
                        list.bind(py)
                            .cast::<PyList>()?
                            .iter()
                            .map(|r| request(&r, &step_id))
                            .collect::<PyResult<Vec<_>>>()
                    });
                built.map_err(|e| error_text(py, &e))
            })
        })
    };
    step.timeout = seconds(timeout);
    step.concurrent = concurrent;
    Ok(step.into())
}

fn internal(py: Python<'_>, obj: &Bound<'_, PyAny>, helpers: &Arc<Helpers>) -> PyResult<Step> {
    let id: String = obj.getattr(intern!(py, "id"))?.extract()?;
    let inputs: Vec<String> = obj.getattr(intern!(py, "inputs"))?.extract()?;
    let timeout: Option<f64> = obj.getattr(intern!(py, "timeout"))?.extract()?;
    let func = obj.getattr(intern!(py, "func"))?.unbind();
    let args = obj.getattr(intern!(py, "args"))?.unbind();
    let kwargs = obj.getattr(intern!(py, "kwargs"))?.unbind();
    let helpers = helpers.clone();
    let (step_id, ids) = (id.clone(), inputs.clone());
    // Runs on a pool thread; the interpreter is held only while Python runs.
    let mut step = InternalStep::new(id, inputs, move |results: &Inputs| {
        Python::attach(|py| {
            let out = inputs_dict(py, &ids, results)
                .and_then(|dict| {
                    helpers
                        .run_internal
                        .call1(py, (&step_id, func, args, kwargs, dict))
                })
                .and_then(|value| step_output(value.bind(py), &step_id));
            out.map_err(|e| error_text(py, &e))
        })
    });
    step.timeout = seconds(timeout);
    Ok(step.into())
}

/// `(status or None, [(name, value)], bytes)` from `dpumesh._steps.output`.
fn step_output(value: &Bound<'_, PyAny>, step: &str) -> PyResult<StepOutput> {
    let (status, headers, body): (Option<u16>, Vec<(String, String)>, Bound<'_, PyAny>) =
        value.extract()?;
    Ok(StepOutput {
        status,
        headers: header_map(&headers, &format!("internal step {step:?}"))?,
        body: Bytes::copy_from_slice(body.cast::<PyBytes>()?.as_bytes()),
        trailers: Default::default(),
        stream: None,
    })
}

/// Whether a dispatcher's answer is a graph (a list of nodes).
pub(crate) fn is_graph(value: &Bound<'_, PyAny>) -> bool {
    PyList::is_type_of(value)
}
