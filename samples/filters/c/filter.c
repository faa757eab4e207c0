// API-key check in C, the sample policy every language implements.
//
// The key in the configured header must be one of the configured keys; the client's
// name goes into `client_header` (replacing any forged value) and the key is removed
// before the request goes upstream; otherwise 401. Denials are counted.
//
// Build: `dpumesh filter build samples/filters/c` (clang for wasm32-wasi, bindings from
// wit-bindgen-c, componentized in-process); test:
// `dpumesh filter test samples/filters/c/build/c.wasm samples/filters/apikey.suite.yaml`.
//
// Ownership (wit-bindgen-c): arguments of exports belong to the export and are freed
// here; returned strings and lists are malloc'd and freed by the generated
// post-return; strings returned by imports belong to the caller. The borrowed request
// head is dropped before returning.

#include <stdlib.h>
#include <string.h>

#include "filter.h"

#define MAX_CLIENTS 64
#define MAX_TEXT 256

typedef struct {
  char name[MAX_TEXT];
  char key[MAX_TEXT];
} client_t;

static char header[MAX_TEXT] = "x-api-key";
static char client_header[MAX_TEXT] = "x-api-client";
static client_t clients[MAX_CLIENTS];
static size_t n_clients = 0;
static dpumesh_filter_metrics_metric_id_t denied;

// --- a small JSON reader for {"header": s, "client_header": s, "keys": {name: s}} ---

typedef struct {
  const char *p;
  const char *end;
  const char *error;
} reader_t;

static void skip_ws(reader_t *r) {
  while (r->p < r->end && (*r->p == ' ' || *r->p == '\n' || *r->p == '\r' || *r->p == '\t'))
    r->p++;
}

static int expect(reader_t *r, char c) {
  skip_ws(r);
  if (r->p < r->end && *r->p == c) {
    r->p++;
    return 1;
  }
  if (!r->error) r->error = "configuration is not the expected JSON";
  return 0;
}

// Reads a JSON string (ASCII escapes only) into out (at most MAX_TEXT - 1 bytes).
static int read_string(reader_t *r, char *out) {
  size_t n = 0;
  if (!expect(r, '"')) return 0;
  while (r->p < r->end && *r->p != '"') {
    char c = *r->p++;
    if (c == '\\') {
      if (r->p >= r->end) break;
      char e = *r->p++;
      switch (e) {
        case '"': case '\\': case '/': c = e; break;
        case 'n': c = '\n'; break;
        case 't': c = '\t'; break;
        default:
          r->error = "unsupported escape in a configuration string";
          return 0;
      }
    }
    if (n + 1 >= MAX_TEXT) {
      r->error = "a configuration string is too long";
      return 0;
    }
    out[n++] = c;
  }
  out[n] = 0;
  return expect(r, '"');
}

static int parse_keys(reader_t *r) {
  if (!expect(r, '{')) return 0;
  skip_ws(r);
  if (r->p < r->end && *r->p == '}') {
    r->p++;
    return 1;
  }
  do {
    if (n_clients == MAX_CLIENTS) {
      r->error = "too many keys";
      return 0;
    }
    client_t *c = &clients[n_clients];
    if (!read_string(r, c->name) || !expect(r, ':') || !read_string(r, c->key)) return 0;
    if (c->key[0] == 0) {
      r->error = "a key is empty";
      return 0;
    }
    for (size_t i = 0; i < n_clients; i++) {
      if (strcmp(clients[i].key, c->key) == 0) {
        r->error = "two clients share a key";
        return 0;
      }
    }
    n_clients++;
    skip_ws(r);
  } while (r->p < r->end && *r->p == ',' && r->p++);
  return expect(r, '}');
}

static const char *parse_config(const char *text, size_t len) {
  reader_t r = {text, text + len, NULL};
  char field[MAX_TEXT];
  n_clients = 0;
  if (!expect(&r, '{')) return r.error;
  skip_ws(&r);
  if (r.p < r.end && *r.p != '}') {
    do {
      if (!read_string(&r, field) || !expect(&r, ':')) return r.error;
      if (strcmp(field, "header") == 0) {
        if (!read_string(&r, header)) return r.error;
      } else if (strcmp(field, "client_header") == 0) {
        if (!read_string(&r, client_header)) return r.error;
      } else if (strcmp(field, "keys") == 0) {
        if (!parse_keys(&r)) return r.error;
      } else {
        return "unknown field in the configuration";
      }
      skip_ws(&r);
    } while (r.p < r.end && *r.p == ',' && r.p++);
  }
  if (!expect(&r, '}')) return r.error;
  skip_ws(&r);
  if (r.p != r.end) return "trailing characters after the configuration";
  if (n_clients == 0) return "keys must name at least one client";
  return NULL;
}

// --- exports ---

bool exports_filter_configure(filter_string_t *config, filter_string_t *err) {
  const char *error = parse_config((const char *)config->ptr, config->len);
  filter_string_free(config);
  if (error) {
    filter_string_dup(err, error);
    return false;
  }
  filter_string_t name;
  filter_string_set(&name, "apikey_denied_total");
  dpumesh_filter_metrics_labels_t labels = {NULL, 0};
  dpumesh_filter_metrics_metric_error_t metric_error;
  if (!dpumesh_filter_metrics_counter(&name, &labels, &denied, &metric_error)) {
    filter_string_dup(err, "cannot define the denial counter");
    return false;
  }
  return true;
}

static void unauthorized(filter_verdict_t *ret, const char *why) {
  filter_tuple2_string_string_t *headers = malloc(2 * sizeof *headers);
  filter_string_dup(&headers[0].f0, "www-authenticate");
  filter_string_dup(&headers[0].f1, "ApiKey");
  filter_string_dup(&headers[1].f0, "content-type");
  filter_string_dup(&headers[1].f1, "text/plain");
  ret->tag = DPUMESH_FILTER_TYPES_VERDICT_DENY;
  ret->val.deny.status = 401;
  ret->val.deny.headers.ptr = headers;
  ret->val.deny.headers.len = 2;
  size_t n = strlen(why);
  char *body = malloc(n + 2);
  memcpy(body, why, n);
  body[n] = '\n';
  body[n + 1] = 0;
  filter_string_dup(&ret->val.deny.body, body);
  free(body);
  dpumesh_filter_metrics_increment(denied, 1);
}

void exports_filter_on_request(filter_request_line_t *line, filter_borrow_request_head_t head,
                               filter_verdict_t *ret) {
  filter_request_line_free(line);
  filter_string_t name, value;
  filter_string_set(&name, header);
  bool present = dpumesh_filter_types_method_request_head_header(head, &name, &value);
  if (!present || value.len == 0) {
    if (present) filter_string_free(&value);
    unauthorized(ret, "missing API key");
    dpumesh_filter_types_request_head_drop_borrow(head);
    return;
  }
  const client_t *found = NULL;
  for (size_t i = 0; i < n_clients; i++) {
    if (strlen(clients[i].key) == value.len && memcmp(clients[i].key, value.ptr, value.len) == 0) {
      found = &clients[i];
      break;
    }
  }
  filter_string_free(&value);
  if (!found) {
    unauthorized(ret, "unknown API key");
    dpumesh_filter_types_request_head_drop_borrow(head);
    return;
  }
  filter_string_t target, client;
  dpumesh_filter_types_header_error_t header_error;
  filter_string_set(&target, client_header);
  filter_string_set(&client, found->name);
  // Configured header names are valid; these edits cannot be refused.
  dpumesh_filter_types_method_request_head_set_header(head, &target, &client, &header_error);
  dpumesh_filter_types_method_request_head_remove_header(head, &name, &header_error);
  ret->tag = DPUMESH_FILTER_TYPES_VERDICT_CONTINUE;
  dpumesh_filter_types_request_head_drop_borrow(head);
}

void exports_filter_on_response(filter_borrow_request_head_t head, filter_response_info_t *info) {
  dpumesh_filter_types_response_info_free(info);
  dpumesh_filter_types_request_head_drop_borrow(head);
}
