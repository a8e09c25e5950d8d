//! Module-head comments (`//!`) must name only things that exist.
//!
//! rustdoc already checks intra-doc links (`[`Type`]`). What it cannot check is prose: a
//! backticked file path that was moved or deleted, or a thread name no code gives a thread
//! any more. This test reads every `//!` comment under `dpu/`, `host/`, `shared/` and
//! `images/` and fails on:
//! * a backticked path with a `/`, or a file name ending in `.rs` or `.md` (backticked or
//!   not), that resolves nowhere: not from the repository root, a crate's `src/`, the
//!   file's own directory or its parent (a directory part with a capital letter is a
//!   placeholder or an API resource name, not a path);
//! * a backticked thread name (`nvmf-reactor-N`, `fabric-tcp-0`, …) in a paragraph that
//!   speaks of threads, when no `thread::Builder::name` in the code makes such a name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use nacre_tests::testbed::repo_root;

const TREES: [&str; 4] = ["dpu", "host", "shared", "images"];
/// Crate source roots a path in a comment may be relative to.
const SRC_ROOTS: [&str; 6] = [
    "dpu/src",
    "dpu/cli/src",
    "host/src",
    "shared/src",
    "images/bfb/src",
    "tests/src",
];
/// Threads nacred has that its own code does not name: the kernel's io_uring workers.
const FOREIGN_THREADS: [&str; 1] = ["iou-wrk-"];
/// Hyphenated words that are protocols, programs or crates, not thread names.
const NOT_THREADS: [&str; 8] = [
    "vhost-user-blk",
    "vhost-user",
    "nvme-tcp",
    "nvme-rdma",
    "nvme-cli",
    "nacre-host",
    "host-channel-less",
    "rdma-sys",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn all_rust_files() -> Vec<PathBuf> {
    let root = repo_root();
    let mut files = Vec::new();
    for t in TREES {
        rust_files(&root.join(t), &mut files);
    }
    files.sort();
    assert!(files.len() > 50, "found only {} Rust files", files.len());
    files
}

/// The `//!` comments of a file, as paragraphs (blank `//!` lines separate them).
fn module_doc_paragraphs(src: &str) -> Vec<String> {
    let mut paras = Vec::new();
    let mut cur = String::new();
    for line in src.lines() {
        let t = line.trim_start();
        let Some(doc) = t.strip_prefix("//!") else {
            if !cur.is_empty() {
                paras.push(std::mem::take(&mut cur));
            }
            continue;
        };
        if doc.trim().is_empty() {
            if !cur.is_empty() {
                paras.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push_str(doc.trim());
            cur.push(' ');
        }
    }
    if !cur.is_empty() {
        paras.push(cur);
    }
    paras
}

/// Backticked spans of a paragraph.
fn spans(para: &str) -> Vec<&str> {
    para.split('`').skip(1).step_by(2).collect()
}

/// Thread names the code gives: exact names and the fixed prefixes of formatted ones
/// (`format!("fabric-tcp-{i}")` gives `fabric-tcp-`).
fn thread_names(files: &[PathBuf]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for f in files {
        let src = std::fs::read_to_string(f).unwrap();
        let mut rest = src.as_str();
        while let Some(at) = rest.find(".name(") {
            rest = &rest[at + ".name(".len()..];
            let call = rest.trim_start();
            let call = call.strip_prefix("format!(").unwrap_or(call);
            if let Some(lit) = call.strip_prefix('"') {
                let lit = &lit[..lit.find('"').unwrap_or(0)];
                let fixed = &lit[..lit.find('{').unwrap_or(lit.len())];
                if fixed.len() >= 3 && fixed.contains('-') {
                    names.insert(fixed.to_string());
                }
            }
        }
    }
    names
}

/// Whether `span` looks like a thread name: lowercase words joined by hyphens, with an
/// optional number or placeholder at the end (`nvmf-reactor-N`, `nvmf-q*`).
fn looks_like_thread(span: &str) -> bool {
    let parts: Vec<&str> = span.split('-').collect();
    parts.len() >= 2
        && parts[0].len() >= 3
        && parts[0].chars().all(|c| c.is_ascii_lowercase())
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "*{}NIQD".contains(c))
        })
}

fn thread_exists(span: &str, names: &BTreeSet<String>) -> bool {
    // A placeholder stands for the formatted part: compare up to it.
    let fixed = span
        .find(|c: char| "*{}".contains(c) || c.is_ascii_uppercase())
        .map_or(span, |i| &span[..i]);
    let fixed = fixed.trim_end_matches(|c: char| c.is_ascii_digit());
    names.iter().any(|n| {
        if n.ends_with('-') {
            span.starts_with(n.as_str()) || n.starts_with(fixed) && !fixed.is_empty()
        } else {
            n == span || (fixed.len() < span.len() && n.starts_with(fixed))
        }
    }) || FOREIGN_THREADS.iter().any(|t| span.starts_with(t))
}

/// Whether `span` is a path this check should resolve.
fn path_like(span: &str) -> bool {
    let bad = |c: char| c.is_whitespace() || "<>{}*$:=,()[]'\"|".contains(c);
    if span.is_empty() || span.chars().any(bad) || span.starts_with('/') || span.starts_with('-') {
        return false;
    }
    if span.starts_with("target/") || span.starts_with("../") || span.contains("://") {
        return false;
    }
    // The repository's directories are lower-case: a directory part with a capital is a
    // placeholder (`DIR/cntrl`) or an API resource name (`nvmeSubsystems/s`), not a path;
    // `…/x` elides one.
    let mut dirs = span.trim_end_matches('/').split('/').rev().skip(1);
    if span.contains('…') || dirs.any(|d| d.chars().any(|c| c.is_ascii_uppercase())) {
        return false;
    }
    span.contains('/')
        && span
            .split('/')
            .all(|c| !c.is_empty() || span.ends_with('/'))
        || (!span.contains('/') && span.ends_with(".rs"))
}

fn resolves(span: &str, file: &Path) -> bool {
    let root = repo_root();
    let here = file.parent().unwrap();
    let mut bases: Vec<PathBuf> = vec![root.clone(), here.to_path_buf()];
    bases.extend(here.parent().map(Path::to_path_buf));
    bases.extend(SRC_ROOTS.iter().map(|s| root.join(s)));
    // A module's own directory (`foo.rs` beside `foo/`).
    bases.push(file.with_extension(""));
    bases
        .iter()
        .any(|b| b.join(span.trim_end_matches('/')).exists())
}

#[test]
fn module_head_comments_name_only_files_and_threads_that_exist() {
    let files = all_rust_files();
    let names = thread_names(&files);
    assert!(
        names.contains("nvmf-reactor-") && names.contains("fabric-tcp-"),
        "the thread-name scan found {names:?}"
    );
    let root = repo_root();
    let mut wrong = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap();
        let rel = f.strip_prefix(&root).unwrap().display().to_string();
        for para in module_doc_paragraphs(&src) {
            let about_threads = para.to_lowercase().contains("thread");
            // Backticked spans, and bare words that name a source or document file.
            let bare = para
                .split(|c: char| c.is_whitespace() || "`(),;\"'".contains(c))
                .map(|w| w.trim_end_matches(['.', ':']))
                .filter(|w| w.ends_with(".rs") || w.ends_with(".md"));
            let mut named: BTreeSet<&str> = spans(&para).into_iter().collect();
            named.extend(bare);
            for s in named {
                if (path_like(s) || (s.ends_with(".md") && !s.contains(' '))) && !resolves(s, f) {
                    wrong.push(format!(
                        "{rel}: names `{s}`, which is not in the repository"
                    ));
                } else if about_threads
                    && looks_like_thread(s)
                    && !NOT_THREADS.contains(&s)
                    && !thread_exists(s, &names)
                {
                    wrong.push(format!(
                        "{rel}: names thread `{s}`, which no code starts (threads: {names:?})"
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "module-head comments that name what does not exist:\n{}",
        wrong.join("\n")
    );
}

/// The checker itself: it must catch what it is for.
#[test]
fn the_checker_flags_a_missing_file_and_a_gone_thread() {
    let files = all_rust_files();
    let names = thread_names(&files);
    let me = repo_root().join("dpu/src/volume/mod.rs");
    assert!(path_like("fabric/tcp.rs") && !resolves("fabric/tcp.rs", &me));
    assert!(path_like("fabric/tcp/rxbuf.rs") && resolves("fabric/tcp/rxbuf.rs", &me));
    assert!(path_like("plug.rs") && resolves("plug.rs", &me));
    assert!(!path_like("/run/nacre") && !path_like("<state-dir>/tls"));
    assert!(!path_like("DIR/cntrl") && !path_like("nvmeSubsystems/s") && !path_like("…/x/y"));
    assert!(path_like("dpu/Cargo.toml") && resolves("dpu/Cargo.toml", &me));
    assert!(looks_like_thread("nvmf-q0-rx") && !thread_exists("nvmf-q0-rx", &names));
    assert!(looks_like_thread("nvmf-q*") && !thread_exists("nvmf-q*", &names));
    assert!(thread_exists("fabric-tcp-0", &names) && thread_exists("nvmf-reactor-N", &names));
    assert!(thread_exists("file-uring", &names) && thread_exists("iou-wrk-3", &names));
}
