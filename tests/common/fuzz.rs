//! What the fuzz targets share.

use proptest::prelude::ProptestConfig;

/// Cases per target: 256, or `PROPTEST_CASES`; shrinking a failure needs no more than 4,096 steps.
pub fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    }
}
