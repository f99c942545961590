//! Bearer tokens, as both services check them: the sidecar's admin token on its TCP API
//! and the bridge's dump token. One check, so the scheme's case rule (RFC 9110 §11.1:
//! case-insensitive) and the constant-time comparison are kept once.

/// Whether an `Authorization` header value carries `token` as a bearer token.
pub fn bearer_matches(header: Option<&str>, token: &str) -> bool {
    let Some((scheme, given)) = header.and_then(|v| v.split_once(' ')) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    let given = given.trim_start();
    // Constant-time comparison: the token is a secret.
    given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::bearer_matches;

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_exact() {
        for h in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"] {
            assert!(bearer_matches(Some(h), "s3cret"), "{h}");
        }
        for h in ["Bearer s3cret!", "Basic s3cret", "s3cret", "Bearer", ""] {
            assert!(!bearer_matches(Some(h), "s3cret"), "{h}");
        }
        assert!(!bearer_matches(None, "s3cret"));
    }
}
