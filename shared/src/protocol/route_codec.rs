//! The binary encoding of a [`RouteRequest`] (`application/x-kvroute-route`): the filter
//! sends long chains as raw little-endian hashes instead of JSON digits.

use super::RouteRequest;

/// Content type of the compact route body: `u32le(len) ++ JSON of the request with an
/// empty chain ++ chain as u64le`. JSON decoding of a 128k-token prompt's chain (8,192
/// hashes) costs ~330 µs in the sidecar; this form is a copy (`kvroute-bench route`).
pub const ROUTE_BINARY_CONTENT_TYPE: &str = "application/x-kvroute-route";

/// Header of a route call: the caller's deadline, Unix milliseconds on the node's clock
/// (the filter and its sidecar share a node). A decision that cannot be answered before
/// it is not committed.
pub const ROUTE_DEADLINE_HEADER: &str = "x-kvroute-deadline-ms";

impl RouteRequest {
    pub fn encode_binary(&self) -> Vec<u8> {
        let head = RouteRequest {
            chain: Vec::new(),
            ..self.clone()
        };
        let json = serde_json::to_vec(&head).unwrap_or_default();
        let mut out = Vec::with_capacity(4 + json.len() + self.chain.len() * 8);
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        for h in &self.chain {
            out.extend_from_slice(&h.to_le_bytes());
        }
        out
    }

    pub fn decode_binary(bytes: &[u8]) -> Result<RouteRequest, String> {
        let (len, rest) = bytes
            .split_first_chunk::<4>()
            .ok_or("binary route body shorter than its header")?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(format!(
                "binary route body: JSON part of {len} bytes is truncated"
            ));
        }
        let (json, chain) = rest.split_at(len);
        let mut req: RouteRequest =
            serde_json::from_slice(json).map_err(|e| format!("binary route body: {e}"))?;
        if chain.len() % 8 != 0 {
            return Err(format!(
                "binary route body: chain of {} bytes is not a whole number of u64",
                chain.len()
            ));
        }
        if !req.chain.is_empty() {
            return Err("binary route body: the JSON part must not carry a chain".into());
        }
        req.chain = chain
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        Ok(req)
    }
}
