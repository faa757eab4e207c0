//! Sizes and durations as people write them in config files: `64KiB`, `5ms`.

use std::time::Duration;

use serde::Deserialize;

/// A duration written `500us`, `5ms`, `2s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span(pub Duration);

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_span(&text)
            .map(Span)
            .map_err(serde::de::Error::custom)
    }
}

fn parse_span(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit (use us, ms or s)"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 5ms"))?;
    match unit.trim() {
        "us" => Ok(Duration::from_micros(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        other => Err(format!(
            "unknown unit {other:?} in {text:?} (use us, ms or s)"
        )),
    }
}

/// A size written `65536`, `64KiB`, `32MiB`, `1GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(usize),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(Self(n)),
            Raw::Text(text) => parse_size(&text)
                .map(Self)
                .map_err(serde::de::Error::custom),
        }
    }
}

fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: usize = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 32MiB"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (use KiB, MiB or GiB)"
            ));
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_spans() {
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("1TB").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
        assert_eq!(parse_span("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_span("2s"), Ok(Duration::from_secs(2)));
        assert!(parse_span("5").is_err());
        assert!(parse_span("ms").is_err());
    }
}
