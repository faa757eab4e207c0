//! Just enough of the Prometheus text format to read the nodes' `/metrics`: samples
//! with their labels; comments and malformed lines are skipped.

use std::collections::BTreeMap;

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of `text`.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(sample).collect()
}

fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i..]),
        None => {
            let (n, v) = line.split_once(' ')?;
            return Some(Sample {
                name: n.to_owned(),
                labels: BTreeMap::new(),
                value: v.split_whitespace().next()?.parse().ok()?,
            });
        }
    };
    let end = rest.rfind('}')?;
    let labels = labels(&rest[1..end])?;
    let value = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

fn labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(match e {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end?;
        out.insert(key.trim_start_matches(',').trim().to_owned(), value);
        rest = after[end + 1..].trim_start_matches(',').trim();
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_with_and_without_labels() {
        let text = "# HELP x\n# TYPE x counter\n\
            dpumesh_pods 3\n\
            dpumesh_denials_total{service=\"hotel\",filter=\"jwt\",status=\"401\"} 17\n\
            weird{a=\"q\\\"uote\"} 1.5\n\
            broken{a=\"x\" \n";
        let s = parse(text);
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].name.as_str(), s[0].value), ("dpumesh_pods", 3.0));
        assert_eq!(s[1].labels["filter"], "jwt");
        assert_eq!(s[1].labels["status"], "401");
        assert_eq!(s[1].value, 17.0);
        assert_eq!(s[2].labels["a"], "q\"uote");
    }
}
