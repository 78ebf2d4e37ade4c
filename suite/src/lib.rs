//! tower-lock's integration tests and benchmark, as a package of their own: see `Cargo.toml`.
//!
//! Nothing here but checks of the repository itself: that every `tests/*.rs` is one of this
//! package's `[[test]]` targets (and every target a file), so that a new test file cannot be
//! left out of the suite unnoticed; and that every relative link of its markdown resolves
//! (`doc_links`).
#![forbid(unsafe_code)]

#[cfg(test)]
mod doc_links;

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, fs, path::Path};

    /// The `path = "..."` of each `[[test]]` (or `[[bench]]`) table of `manifest`.
    fn target_paths(manifest: &str, table: &str) -> BTreeSet<String> {
        let mut paths = BTreeSet::new();
        let mut inside = false;
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                inside = line == table;
            } else if inside && let Some(value) = line.strip_prefix("path") {
                let value = value.trim_start().trim_start_matches('=').trim();
                paths.insert(value.trim_matches('"').to_owned());
            }
        }
        paths
    }

    #[test]
    fn every_test_file_is_a_target() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = fs::read_to_string(here.join("Cargo.toml")).unwrap();
        let registered = target_paths(&manifest, "[[test]]");
        let files: BTreeSet<String> = fs::read_dir(here.join("../tests"))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".rs"))
            .map(|name| format!("../tests/{name}"))
            .collect();
        let missing: Vec<_> = files.difference(&registered).collect();
        assert!(
            missing.is_empty(),
            "test files that are no target of suite/Cargo.toml, so never run: {missing:?}; add \
             a [[test]] table (name = the file's stem, path = \"../tests/<file>\") for each"
        );
        let stale: Vec<_> = registered.difference(&files).collect();
        assert!(
            stale.is_empty(),
            "suite/Cargo.toml lists test files that do not exist: {stale:?}"
        );
        for bench in target_paths(&manifest, "[[bench]]") {
            assert!(here.join(&bench).is_file(), "no benchmark at {bench}");
        }
    }

    #[test]
    fn targets_are_read_from_the_manifest() {
        let manifest = "[lib]\npath = \"src/lib.rs\"\n\n[[test]]\nname = \"a\"\npath = \"../tests/a.rs\"\n\n\
                        [[bench]]\nname = \"b\"\npath = \"../benches/b/main.rs\"\n";
        assert_eq!(
            target_paths(manifest, "[[test]]"),
            BTreeSet::from(["../tests/a.rs".to_owned()])
        );
        assert_eq!(
            target_paths(manifest, "[[bench]]"),
            BTreeSet::from(["../benches/b/main.rs".to_owned()])
        );
    }
}
