//! The batched call (WIT 0.1.1 `handle-request`): what the filter declared arrives in
//! the call's input; header edits, metadata and counters go back with the verdict.
//! Reads see the call's own edits, as they do through the proxy.

use std::cell::RefCell;

use crate::bindings::dpumesh::filter::types as wit;
use crate::input::{Input, Interest, check_header_edit};
use crate::{Claim, HeadAccess, HeaderError, Method, Peer, RequestLine, Scheme};

/// The head as a batched call sees it.
pub(crate) struct BatchedHead<'a> {
    head: &'a wit::RequestHead,
    input: Input<'a>,
    interest: &'a Interest,
    edits: RefCell<Vec<wit::HeaderEdit>>,
    metadata: RefCell<Vec<(String, String)>>,
}

fn edit_name(edit: &wit::HeaderEdit) -> &str {
    match edit {
        wit::HeaderEdit::Set((name, _)) | wit::HeaderEdit::Append((name, _)) => name,
        wit::HeaderEdit::Remove(name) => name,
    }
}

impl<'a> BatchedHead<'a> {
    pub(crate) fn new(
        head: &'a wit::RequestHead,
        input: Input<'a>,
        interest: &'a Interest,
    ) -> Self {
        Self {
            head,
            input,
            interest,
            edits: RefCell::new(Vec::new()),
            metadata: RefCell::new(Vec::new()),
        }
    }

    /// What goes back with the verdict.
    pub(crate) fn finish(self) -> (Vec<wit::HeaderEdit>, Vec<(String, String)>) {
        (self.edits.into_inner(), self.metadata.into_inner())
    }

    /// The values of `name` as the input brought them, if the filter declared it.
    fn declared_header(&self, name: &str) -> Option<impl Iterator<Item = &'a str> + use<'a>> {
        self.interest
            .headers
            .iter()
            .position(|h| h.eq_ignore_ascii_case(name))
            .map(|i| self.input.header(i))
    }

    fn edited(&self, name: &str) -> bool {
        self.edits
            .borrow()
            .iter()
            .any(|e| edit_name(e).eq_ignore_ascii_case(name))
    }

    /// `values` (as the head had them) with this call's edits of `name` applied.
    fn with_edits(&self, name: &str, mut values: Vec<String>) -> Vec<String> {
        for edit in self.edits.borrow().iter() {
            if !edit_name(edit).eq_ignore_ascii_case(name) {
                continue;
            }
            match edit {
                wit::HeaderEdit::Set((_, v)) => values = vec![v.clone()],
                wit::HeaderEdit::Append((_, v)) => values.push(v.clone()),
                wit::HeaderEdit::Remove(_) => values.clear(),
            }
        }
        values
    }

    fn edit(&self, edit: wit::HeaderEdit, value: Option<&str>) -> Result<(), HeaderError> {
        check_header_edit(edit_name(&edit), value)?;
        self.edits.borrow_mut().push(edit);
        Ok(())
    }
}

impl HeadAccess for BatchedHead<'_> {
    fn line(&self) -> RequestLine {
        self.input.line()
    }

    fn method(&self) -> Method {
        Method::parse(self.input.method())
    }

    fn scheme(&self) -> Scheme {
        self.input.scheme
    }

    fn authority(&self) -> String {
        self.input.authority().to_owned()
    }

    fn path(&self) -> String {
        self.input.path().to_owned()
    }

    fn query(&self) -> Option<String> {
        self.input.query().map(str::to_owned)
    }

    fn header(&self, name: &str) -> Option<String> {
        if self.edited(name) {
            return self.header_all(name).into_iter().next();
        }
        match self.declared_header(name) {
            Some(mut values) => values.next().map(str::to_owned),
            None => self.head.header(name),
        }
    }

    fn header_all(&self, name: &str) -> Vec<String> {
        let base = match self.declared_header(name) {
            Some(values) => values.map(str::to_owned).collect(),
            None => self.head.header_all(name),
        };
        self.with_edits(name, base)
    }

    fn headers(&self, names: &[&str]) -> Vec<Option<String>> {
        // Names neither declared nor edited are fetched together, in one call.
        let fetch: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| self.declared_header(n).is_none() && !self.edited(n))
            .collect();
        let mut fetched = if fetch.is_empty() {
            Vec::new()
        } else {
            self.head.headers(&fetch)
        }
        .into_iter();
        names
            .iter()
            .map(|n| {
                if self.declared_header(n).is_none() && !self.edited(n) {
                    fetched.next().flatten()
                } else {
                    self.header(n)
                }
            })
            .collect()
    }

    fn header_names(&self) -> Vec<String> {
        let mut names = self.head.header_names();
        for edit in self.edits.borrow().iter() {
            let name = edit_name(edit).to_ascii_lowercase();
            match edit {
                wit::HeaderEdit::Remove(_) => names.retain(|n| *n != name),
                _ if !names.contains(&name) => names.push(name),
                _ => {}
            }
        }
        names
    }

    fn source(&self) -> Peer {
        self.input.source()
    }

    fn destination(&self) -> Option<String> {
        self.input.destination().map(str::to_owned)
    }

    fn set_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.edit(
            wit::HeaderEdit::Set((name.to_owned(), value.to_owned())),
            Some(value),
        )
    }

    fn append_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.edit(
            wit::HeaderEdit::Append((name.to_owned(), value.to_owned())),
            Some(value),
        )
    }

    fn remove_header(&self, name: &str) -> Result<(), HeaderError> {
        self.edit(wit::HeaderEdit::Remove(name.to_owned()), None)
    }

    fn metadata(&self, key: &str) -> Option<String> {
        if let Some((_, v)) = self.metadata.borrow().iter().rev().find(|(k, _)| k == key) {
            return Some(v.clone());
        }
        match self.interest.metadata.iter().position(|k| k == key) {
            Some(i) => self.input.metadata(i).map(str::to_owned),
            None => self.head.metadata(key),
        }
    }

    fn set_metadata(&self, key: &str, value: &str) {
        // Appended without looking for the key: the proxy applies entries in order
        // (the last one for a key wins) and reads look from the end, so a filter that
        // writes a dozen keys does not compare each with all before it.
        self.metadata
            .borrow_mut()
            .push((key.to_owned(), value.to_owned()));
    }

    fn times(&self) -> Option<(u64, u64)> {
        Some((self.input.wall_ns, self.input.monotonic_ns))
    }

    fn claims(&self, names: &[&str]) -> Option<Vec<Option<Claim>>> {
        crate::guest::send_pending_payload(self.head, &self.metadata.borrow());
        crate::guest::claims_from_proxy(self.head, names)
    }
}
