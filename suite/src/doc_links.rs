//! Every relative link of the repository's markdown (the README, the changelog, `docs/*.md`,
//! `faults/README.md`) names a file that exists and, for a link into a markdown file, a heading
//! that file has: so that a section moved from one document to another leaves no link behind.
//!
//! Anchors are GitHub's: a heading's text in lower case, without its punctuation, spaces made
//! hyphens, and `-1`, `-2`, ... after a repeated one. Links inside code (fenced blocks, inline
//! spans) are text, not links. Links to other sites are not followed.

use std::{
    collections::{BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
};

/// The markdown files whose links are checked, relative to the repository's root.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![
        root.join("README.md"),
        root.join("CHANGELOG.md"),
        root.join("faults/README.md"),
    ];
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of `text` outside fenced code blocks, with their line numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(marker)) => fence = Some(marker),
            (Some(open), Some(marker)) if open == marker => fence = None,
            (None, None) => lines.push((index + 1, line)),
            _ => {}
        }
    }
    lines
}

/// A line without its inline code spans.
fn without_code_spans(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join("")
}

/// GitHub's anchor for a heading's text (a code span's text stays, its backticks go).
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a markdown text has, one per heading.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let level = line.bytes().take_while(|&b| b == b'#').count();
        let Some(heading) = line.get(level..).and_then(|rest| rest.strip_prefix(' ')) else {
            continue;
        };
        if !(1..=6).contains(&level) {
            continue;
        }
        let base = slug(heading);
        let count = seen.entry(base.clone()).or_default();
        anchors.insert(match *count {
            0 => base,
            n => format!("{base}-{n}"),
        });
        *count += 1;
    }
    anchors
}

/// The targets of a markdown text's inline links (`[text](target)`, images too), with the
/// line each is on.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut targets = Vec::new();
    for (number, line) in prose_lines(text) {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            targets.push((number, target.trim_matches(['<', '>']).to_owned()));
            rest = &rest[end..];
        }
    }
    targets
}

/// What is wrong with the relative links of `file` (whose text is `text`), one line each.
fn broken_links(file: &Path, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    for (line, target) in link_targets(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = target.split_once('#').unwrap_or((target.as_str(), ""));
        let at = format!("{}:{line}: `{target}`", file.display());
        let headings = if path.is_empty() {
            anchors(text)
        } else {
            let linked = file.parent().expect("a file in a folder").join(path);
            if !linked.exists() {
                broken.push(format!("{at}: no file {}", linked.display()));
                continue;
            }
            if anchor.is_empty() || linked.extension().is_none_or(|ext| ext != "md") {
                continue;
            }
            anchors(&fs::read_to_string(&linked).expect("read a linked file"))
        };
        if !anchor.is_empty() && !headings.contains(anchor) {
            broken.push(format!("{at}: no heading with the anchor #{anchor}"));
        }
    }
    broken
}

#[test]
fn every_relative_link_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("suite/ is in the repository");
    let mut broken = Vec::new();
    for file in markdown_files(root) {
        let text = fs::read_to_string(&file).expect("read a markdown file");
        broken.extend(broken_links(&file, &text));
    }
    assert!(
        broken.is_empty(),
        "links to files or headings that do not exist (a moved section's old address?); point \
         each at where its section is now:\n{}",
        broken.join("\n")
    );
}

#[test]
fn anchors_are_githubs() {
    let text = "# tower-lock\n## What it guarantees, and what it does not\n\
                ## `layer` or `route_layer`\n```sh\n# not a heading\n```\n\
                ## Redlock: N independent masters\n### Notes\n### Notes\n#nota heading\n";
    assert_eq!(
        anchors(text),
        BTreeSet::from(
            [
                "tower-lock",
                "what-it-guarantees-and-what-it-does-not",
                "layer-or-route_layer",
                "redlock-n-independent-masters",
                "notes",
                "notes-1",
            ]
            .map(str::to_owned)
        )
    );
}

#[test]
fn a_link_to_a_missing_file_or_heading_is_reported() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("suite/ is in the repository");
    let readme = root.join("README.md");
    let text = "## The demo\n[ok](docs/GUIDE.md#keys) [here](#the-demo) [out](https://x.org/#x)\n\
                `[code](nowhere.md)`\n```md\n[code](nowhere.md)\n```\n\
                [gone](docs/NOWHERE.md) [moved](docs/GUIDE.md#no-such-section)\n\
                [split\ntext](#no-such-heading)\n";
    let broken = broken_links(&readme, text);
    assert_eq!(broken.len(), 3, "{broken:#?}");
    assert!(broken[0].contains("docs/NOWHERE.md") && broken[0].contains("no file"));
    assert!(broken[1].contains("#no-such-section"));
    assert!(broken[2].contains(":9:") && broken[2].contains("#no-such-heading"));
}
