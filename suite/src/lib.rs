//! tower-lock's integration tests and benchmark, as a package of their own: see `Cargo.toml`.
//!
//! Nothing here but checks of the repository itself: that every `tests/*.rs` is one of this
//! package's `[[test]]` targets (or `model/`'s: the loom model), or a module of the
//! `integration` one (`tests/integration.rs`),
//! and not both, and that every target and module is a file, so that a new test file cannot be
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

    /// The files of the modules that `root` (a crate root in `tests/`) declares as `mod name;`,
    /// as `../tests/name.rs`; a module with a directory of its own (`mod.rs`) is none of them.
    fn module_paths(root: &str, tests: &Path) -> BTreeSet<String> {
        // Read line by line: a module hidden by an attribute (`#[cfg(..)]`) or a block comment
        // would be counted and never run.
        assert!(
            !root.contains("/*"),
            "no block comments in tests/integration.rs"
        );
        let lines: Vec<&str> = root.lines().map(str::trim).collect();
        for pair in lines.windows(2) {
            assert!(
                !(pair[0].starts_with("#[") && pair[1].starts_with("mod ")),
                "`{}` before `{}` in tests/integration.rs: declare modules without attributes (a \
                 file gates itself with `#![cfg(..)]`)",
                pair[0],
                pair[1]
            );
        }
        lines
            .iter()
            .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
            .filter(|name| !tests.join(name).join("mod.rs").is_file())
            .map(|name| format!("../tests/{name}.rs"))
            .collect()
    }

    #[test]
    fn every_test_file_is_a_target() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = fs::read_to_string(here.join("Cargo.toml")).unwrap();
        // The loom model's binary is `model/`'s (both packages' paths start `../tests/`).
        let model = fs::read_to_string(here.join("../model/Cargo.toml")).unwrap();
        let suite_targets = target_paths(&manifest, "[[test]]");
        let model_targets = target_paths(&model, "[[test]]");
        let twice: Vec<_> = suite_targets.intersection(&model_targets).collect();
        assert!(
            twice.is_empty(),
            "test files that are a target of suite/Cargo.toml and of model/Cargo.toml: {twice:?}"
        );
        let targets: BTreeSet<String> = suite_targets.union(&model_targets).cloned().collect();
        let integration = fs::read_to_string(here.join("../tests/integration.rs")).unwrap();
        let modules = module_paths(&integration, &here.join("../tests"));
        let both: Vec<_> = targets.intersection(&modules).collect();
        assert!(
            both.is_empty(),
            "test files that are a target of suite/Cargo.toml (or model/Cargo.toml) and a module \
             of tests/integration.rs, so run twice: {both:?}"
        );
        let registered: BTreeSet<String> = targets.union(&modules).cloned().collect();
        let files: BTreeSet<String> = fs::read_dir(here.join("../tests"))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".rs"))
            .map(|name| format!("../tests/{name}"))
            .collect();
        let missing: Vec<_> = files.difference(&registered).collect();
        assert!(
            missing.is_empty(),
            "test files that are neither a module of tests/integration.rs nor a target of \
             suite/Cargo.toml, so never run: {missing:?}; add a `mod <stem>;` to \
             tests/integration.rs for each (or, for a file whose tests need a process of their \
             own, a [[test]] table: name = the file's stem, path = \"../tests/<file>\")"
        );
        let stale: Vec<_> = registered.difference(&files).collect();
        assert!(
            stale.is_empty(),
            "suite/Cargo.toml or tests/integration.rs name test files that do not exist: \
             {stale:?}"
        );
        for bench in target_paths(&manifest, "[[bench]]") {
            assert!(here.join(&bench).is_file(), "no benchmark at {bench}");
        }
    }

    #[test]
    fn modules_are_read_from_the_root() {
        let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests");
        let root = "//! docs\nmod support;\n\nmod acl;\nmod tls;\n";
        assert_eq!(
            module_paths(root, &tests),
            BTreeSet::from(["../tests/acl.rs".to_owned(), "../tests/tls.rs".to_owned()])
        );
        for hidden in [
            "mod acl;\n#[cfg(any())]\nmod tls;\n",
            "mod acl;\n/* mod tls; */\n",
        ] {
            let read = std::panic::catch_unwind(|| module_paths(hidden, &tests));
            assert!(read.is_err(), "{hidden:?} was read as if every module ran");
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
