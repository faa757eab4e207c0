//! The `request-head` resource: what a filter reads and edits of the head lent to its
//! call.

use wasmtime::component::Resource;

use super::{HeadHandle, StoreState};
use crate::bindings::dpumesh::filter::types;

pub(crate) fn header_error(e: dpumesh_head::HeaderError) -> types::HeaderError {
    match e {
        dpumesh_head::HeaderError::InvalidName => types::HeaderError::InvalidName,
        dpumesh_head::HeaderError::InvalidValue => types::HeaderError::InvalidValue,
        dpumesh_head::HeaderError::ReadOnly => types::HeaderError::ReadOnly,
    }
}

/// The method as the world passes it: common methods as cases, others as text.
pub(crate) fn wit_method(method: &str) -> types::Method {
    match method {
        "GET" => types::Method::Get,
        "HEAD" => types::Method::Head,
        "POST" => types::Method::Post,
        "PUT" => types::Method::Put,
        "DELETE" => types::Method::Delete,
        "CONNECT" => types::Method::Connect,
        "OPTIONS" => types::Method::Options,
        "TRACE" => types::Method::Trace,
        "PATCH" => types::Method::Patch,
        other => types::Method::Other(other.to_owned()),
    }
}

fn wit_claim(claim: dpumesh_claims::Claim) -> types::Claim {
    match claim {
        dpumesh_claims::Claim::Text(s) => types::Claim::Text(s),
        dpumesh_claims::Claim::TextList(items) => types::Claim::TextList(items),
        dpumesh_claims::Claim::Json(json) => types::Claim::Json(json),
    }
}

pub(crate) fn wit_scheme(scheme: &str) -> types::Scheme {
    if scheme.eq_ignore_ascii_case("https") {
        types::Scheme::Https
    } else {
        types::Scheme::Http
    }
}

impl types::Host for StoreState {}

impl types::HostRequestHead for StoreState {
    fn method(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<types::Method> {
        Ok(wit_method(&self.head()?.method))
    }

    fn scheme(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<types::Scheme> {
        Ok(wit_scheme(&self.head()?.scheme))
    }

    fn authority(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<String> {
        Ok(self.head()?.authority.clone())
    }

    fn path(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<String> {
        Ok(self.head()?.path.clone())
    }

    fn query(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.query.clone())
    }

    fn header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
    ) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.header(&name))
    }

    fn header_all(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
    ) -> wasmtime::Result<Vec<String>> {
        Ok(self.head()?.header_all(&name))
    }

    fn headers(
        &mut self,
        _: Resource<HeadHandle>,
        names: Vec<String>,
    ) -> wasmtime::Result<Vec<Option<String>>> {
        self.headers_named(&names)
    }

    fn header_names(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<Vec<String>> {
        Ok(self.head()?.header_names())
    }

    fn source(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<types::Peer> {
        let source = &self.head()?.source;
        Ok(types::Peer {
            address: source.addr.ip().to_string(),
            port: source.addr.port(),
            identity: source.identity.clone(),
        })
    }

    fn destination(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.destination.clone())
    }

    fn set_header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
        value: String,
    ) -> wasmtime::Result<Result<(), types::HeaderError>> {
        Ok(self
            .head_mut()?
            .set_header(&name, &value)
            .map_err(header_error))
    }

    fn append_header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
        value: String,
    ) -> wasmtime::Result<Result<(), types::HeaderError>> {
        Ok(self
            .head_mut()?
            .append_header(&name, &value)
            .map_err(header_error))
    }

    fn remove_header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
    ) -> wasmtime::Result<Result<(), types::HeaderError>> {
        Ok(self.head_mut()?.remove_header(&name).map_err(header_error))
    }

    fn metadata(
        &mut self,
        _: Resource<HeadHandle>,
        key: String,
    ) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.metadata(&key).map(str::to_owned))
    }

    fn set_metadata(
        &mut self,
        _: Resource<HeadHandle>,
        key: String,
        value: String,
    ) -> wasmtime::Result<()> {
        self.head_mut()?.set_metadata(&key, &value);
        Ok(())
    }

    fn set_metadata_batch(
        &mut self,
        _: Resource<HeadHandle>,
        entries: Vec<(String, String)>,
    ) -> wasmtime::Result<()> {
        self.set_metadata_entries(entries.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    fn claims(
        &mut self,
        _: Resource<HeadHandle>,
        names: Vec<String>,
    ) -> wasmtime::Result<Option<Vec<Option<types::Claim>>>> {
        self.claims_named(&names)
    }

    fn drop(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<()> {
        // Heads are only ever lent (borrowed), never owned by a guest.
        Ok(())
    }
}

/// The head's reads and writes that take their names borrowed: the component path
/// passes what it lifted, the core path what it reads in place in the guest's memory.
impl StoreState {
    pub(crate) fn headers_named(
        &self,
        names: &[impl AsRef<str>],
    ) -> wasmtime::Result<Vec<Option<String>>> {
        let head = self.head()?;
        Ok(names
            .iter()
            .map(|name| head.header(name.as_ref()))
            .collect())
    }

    /// The claims at `names` of the verified payload the head carries, from the
    /// parsed copy kept per payload; `None` without a payload.
    pub(crate) fn claims_named(
        &mut self,
        names: &[impl AsRef<str>],
    ) -> wasmtime::Result<Option<Vec<Option<types::Claim>>>> {
        let head = self.head.as_deref().ok_or_else(super::no_head)?;
        let Some(payload) = head.metadata(dpumesh_claims::PAYLOAD_KEY) else {
            return Ok(None);
        };
        let Some(claims) = self.claims.get(payload) else {
            return Ok(None);
        };
        Ok(Some(
            names
                .iter()
                .map(|name| claims.claim(name.as_ref()).map(wit_claim))
                .collect(),
        ))
    }

    /// Metadata entries in order (the last for a key wins), copied from borrowed
    /// strings into the head (a value overwritten in place keeps its buffer).
    pub(crate) fn set_metadata_entries<'e>(
        &mut self,
        entries: impl IntoIterator<Item = (&'e str, &'e str)>,
    ) -> wasmtime::Result<()> {
        let head = self.head_mut()?;
        for (key, value) in entries {
            head.set_metadata(key, value);
        }
        Ok(())
    }
}
