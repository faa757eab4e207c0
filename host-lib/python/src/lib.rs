//! `dpumesh._native`: the Rust half of the `dpumesh` Python package. The graph API,
//! WSGI glue and checks are Python (`python/dpumesh`); this runs dpumesh-host's event
//! loop for them, turning the graphs Python handlers build into the Rust library's
//! nodes and calling back into Python for internal steps and request builders.

mod graph;
mod handler;
mod reactor;
mod reader;
mod reply;
mod result;
mod serve;
mod store;
mod testing;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<result::PyStepResult>()?;
    m.add_class::<testing::TestMesh>()?;
    m.add_class::<reactor::Reactor>()?;
    m.add_class::<reply::Reply>()?;
    m.add_class::<reader::BodyReader>()?;
    m.add_class::<store::PyStoreClient>()?;
    m.add_class::<store::PyStoreBuffer>()?;
    m.add_class::<store::PyTransfer>()?;
    m.add_function(wrap_pyfunction!(serve::serve, m)?)?;
    m.add_function(wrap_pyfunction!(testing::bench_rust, m)?)?;
    Ok(())
}
