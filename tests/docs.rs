//! The documentation: README.md and the pages under docs/. Every relative
//! link resolves (the file or directory exists) and every `#anchor` names a
//! heading of the Markdown file it points into, by GitHub's rules. External
//! `http(s)://` and `mailto:` links are not checked. README lists every
//! page of docs/ and stays a short introduction.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown page under docs/.
fn documents() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    let mut all = vec![repo().join("README.md")];
    all.extend(pages);
    all
}

/// The text with every fenced code block (``` or ~~~) blanked, line for
/// line, so that what remains is prose, headings and links, and line
/// numbers still match the file.
fn without_fences(text: &str) -> String {
    let mut fence: Option<(char, usize)> = None;
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let trimmed = line.trim_start();
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        let run = marker.map_or(0, |m| trimmed.chars().take_while(|c| *c == m).count());
        match (fence, marker) {
            (None, Some(m)) if run >= 3 => fence = Some((m, run)),
            (Some((m, n)), Some(c)) if c == m && run >= n && trimmed[run..].trim().is_empty() => {
                fence = None
            }
            (None, _) => out.push_str(line),
            _ => {}
        }
        out.push('\n');
    }
    out
}

/// The text with the content of every inline code span blanked (newlines
/// kept): what is quoted as code is not a link.
fn without_code_spans(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out: Vec<char> = chars.clone();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let open = chars[i..].iter().take_while(|c| **c == '`').count();
        // The closing run has exactly as many backticks.
        let mut j = i + open;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let run = chars[j..].iter().take_while(|c| **c == '`').count();
                if run == open {
                    close = Some(j);
                    break;
                }
                j += run;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                for c in &mut out[i + open..j] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = j + open;
            }
            None => i += open,
        }
    }
    out.into_iter().collect()
}

/// Every link target in the Markdown text, with its line: inline links and
/// images (`[text](target "title")`) and reference definitions
/// (`[label]: target`), outside code.
fn link_targets(markdown: &str) -> Vec<(usize, String)> {
    let text = without_code_spans(&without_fences(markdown));
    let line_of = |byte: usize| text[..byte].matches('\n').count() + 1;
    let mut targets = Vec::new();
    for (at, _) in text.match_indices("](") {
        let rest = &text[at + 2..];
        let target = match rest.strip_prefix('<') {
            Some(inner) => inner.split('>').next().unwrap_or_default().to_owned(),
            None => {
                // Up to white space or the `)` that closes the link,
                // allowing balanced parentheses inside.
                let mut depth = 0;
                rest.chars()
                    .take_while(|&c| match c {
                        '(' => {
                            depth += 1;
                            true
                        }
                        ')' if depth == 0 => false,
                        ')' => {
                            depth -= 1;
                            true
                        }
                        c => !c.is_whitespace(),
                    })
                    .collect()
            }
        };
        targets.push((line_of(at), target));
    }
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix('[')
            && let Some((label, def)) = rest.split_once("]:")
            && !label.is_empty()
            && let Some(target) = def.split_whitespace().next()
        {
            let target = target.trim_start_matches('<').trim_end_matches('>');
            targets.push((n + 1, target.to_owned()));
        }
    }
    targets
}

/// The anchor GitHub derives from a heading's text, before duplicates are
/// numbered: lower case, spaces to `-`, and every character dropped that is
/// not a letter, a digit, `-` or `_`. Inline markup counts as its text: a
/// link as its text, code and emphasis without their markers.
fn github_anchor(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading.trim();
    // [text](target) -> text
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|i| open + i) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|i| close + i) else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a Markdown document's headings get, in order: GitHub
/// numbers a repeated anchor `-1`, `-2`, ... (skipping any taken).
fn anchors(markdown: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut all = Vec::new();
    for line in without_fences(markdown).lines() {
        let trimmed = line.trim_start();
        if line.len() - trimmed.len() > 3 {
            continue; // indented: code, not a heading
        }
        let level = trimmed.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&level) {
            continue;
        }
        let after = &trimmed[level..];
        if !(after.is_empty() || after.starts_with(' ') || after.starts_with('\t')) {
            continue; // "#hashtag", not a heading
        }
        // A closing sequence of `#`s is not part of the heading.
        let text = after.trim();
        let text = match text.trim_end_matches('#') {
            t if t.is_empty() || t.ends_with(' ') => t.trim_end(),
            _ => text,
        };
        let base = github_anchor(text);
        let mut anchor = base.clone();
        while seen.contains_key(&anchor) {
            let n = seen.get_mut(&base).map_or(1, |n| {
                *n += 1;
                *n
            });
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor.clone(), 0);
        all.push(anchor);
    }
    all
}

fn is_external(target: &str) -> bool {
    let lower = target.to_ascii_lowercase();
    ["http://", "https://", "mailto:"]
        .iter()
        .any(|scheme| lower.starts_with(scheme))
}

/// What is wrong with the link `target` written in `document`, if anything.
fn broken(document: &Path, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link".to_owned());
    }
    if is_external(target) {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = match path {
        "" => document.to_path_buf(),
        p if p.starts_with('/') => return Some("an absolute path".to_owned()),
        p => document.parent().unwrap().join(p),
    };
    let shown = file.strip_prefix(repo()).unwrap_or(&file).display();
    if !file.exists() {
        return Some(format!("{shown} does not exist"));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|e| e != "md") {
        return Some(format!("an anchor into {shown}, not Markdown"));
    }
    let headings = anchors(&std::fs::read_to_string(&file).unwrap());
    match headings.iter().any(|a| a == anchor) {
        true => None,
        false => Some(format!("{shown} has no heading with anchor #{anchor}")),
    }
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        let name = document.strip_prefix(repo()).unwrap().display().to_string();
        for (line, target) in link_targets(&text) {
            checked += 1;
            if let Some(why) = broken(&document, &target) {
                problems.push(format!("{name}:{line}: ({target}): {why}"));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: is the parser broken?"
    );
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn readme_lists_every_docs_page() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let linked: Vec<String> = link_targets(&readme).into_iter().map(|(_, t)| t).collect();
    let missing: Vec<String> = documents()
        .iter()
        .skip(1)
        .map(|p| format!("docs/{}", p.file_name().unwrap().to_str().unwrap()))
        .filter(|page| !linked.iter().any(|t| t.split('#').next() == Some(page)))
        .collect();
    assert!(missing.is_empty(), "README.md does not link {missing:?}");
}

#[test]
fn readme_is_a_short_introduction_with_the_two_commands() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: move the details to a page of docs/"
    );
    // Running the service, and the test command `.ci/run` runs.
    for command in ["cargo run --release", "./scripts/test"] {
        assert!(
            readme.contains(&format!("```sh\n{command}\n```")),
            "README.md does not show `{command}` in a block of its own"
        );
    }
}

#[test]
fn anchors_follow_github() {
    assert_eq!(
        github_anchor("Alert: TallyTargetDown"),
        "alert-tallytargetdown"
    );
    assert_eq!(
        github_anchor("PostgreSQL: many replicas, one truth"),
        "postgresql-many-replicas-one-truth"
    );
    assert_eq!(
        github_anchor("PostgreSQL, and when to choose which engine"),
        "postgresql-and-when-to-choose-which-engine"
    );
    assert_eq!(
        github_anchor("`tally contention` & *why*"),
        "tally-contention--why"
    );
    assert_eq!(
        github_anchor("snake_case and kebab-case"),
        "snake_case-and-kebab-case"
    );
    assert_eq!(github_anchor("See [the API](api.md)!"), "see-the-api");
    assert_eq!(github_anchor("Über 100 %"), "über-100-");

    let doc = "# Usage\n\n## Usage\n\n```sh\n# Usage, in code: no heading\n```\n\
               ### Usage ###\n    # indented: code\n#hashtag\n## Usage 1\n";
    assert_eq!(
        anchors(doc),
        ["usage", "usage-1", "usage-2", "usage-1-1"],
        "repeated headings are numbered, code is not a heading"
    );
}

#[test]
fn links_are_found_outside_code_only() {
    let doc = "See [API](docs/api.md#write-errors) and [a\nwrapped link](x.md).\n\
               `[not](a-link.md)` and ![image](img/a.png \"title\")\n\
               ```\n[in](code.md)\n```\n[ref]: <docs/ref.md>\n\
               [paren](a_(b).md) [ext](https://example.com/x)\n";
    let targets: Vec<String> = link_targets(doc).into_iter().map(|(_, t)| t).collect();
    assert_eq!(
        targets,
        [
            "docs/api.md#write-errors",
            "x.md",
            "img/a.png",
            "a_(b).md",
            "https://example.com/x",
            "docs/ref.md",
        ]
    );
    assert!(is_external("HTTPS://example.com"));
    assert!(!is_external("docs/api.md"));
}
