//! The README, run as written.
//!
//! * Its five-minute tour: every `sh` block under the heading [`TOUR`] runs, in order, in one
//!   bash (`set -euo pipefail`), with the freshly built binaries first on `PATH`, against a
//!   nacred this test starts as `scripts/run` does (its defaults, the embedded default disk).
//!   The tour's addresses and ports are fixed, so it runs in a network namespace of its own
//!   (`unshare --net`, loopback brought up) where no other test's listener can be; `HOME`
//!   and nacred's state and run directories are in a temporary directory. A line
//!   `scripts/run ARGS` restarts that nacred with `ARGS`: what `scripts/run` does once it has
//!   built.
//! * Its two commands: `.ci/run` runs exactly the README's test command, and
//!   `scripts/fresh-machine` runs its run command.

use std::process::{Command, Stdio};

use nacre_tests::daemon::bin;
use nacre_tests::testbed::repo_root;

/// The tour's heading in README.md.
const TOUR: &str = "## A five-minute tour";

fn readme() -> String {
    std::fs::read_to_string(repo_root().join("README.md")).expect("README.md")
}

/// The bodies of the ```sh blocks in `text`, in order.
fn sh_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        match (&mut cur, line.trim_end()) {
            (None, "```sh") => cur = Some(String::new()),
            (Some(_), "```") => blocks.push(cur.take().expect("open block")),
            (Some(b), l) => {
                b.push_str(l);
                b.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(cur.is_none(), "README.md: a ```sh block is never closed");
    blocks
}

/// From `heading` to the next heading of the same level.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("README.md has no heading {heading:?}"));
    let body = &text[start + heading.len() + 2..];
    let end = body.find("\n## ").unwrap_or(body.len());
    &body[..end]
}

/// The README's run command: its first code block, one line.
fn run_command(text: &str) -> String {
    let first = sh_blocks(text)
        .into_iter()
        .next()
        .expect("a first sh block");
    let cmd = first.trim();
    assert_eq!(
        cmd.lines().count(),
        1,
        "the run command is one line: {first:?}"
    );
    cmd.to_string()
}

/// The README's test command: the first code block after "**Test it**", one line.
fn test_command(text: &str) -> String {
    let at = text
        .find("**Test it**")
        .expect("README.md says **Test it**");
    let block = sh_blocks(&text[at..])
        .into_iter()
        .next()
        .expect("a code block after **Test it**");
    let cmd = block.trim();
    assert_eq!(
        cmd.lines().count(),
        1,
        "the test command is one line: {block:?}"
    );
    cmd.to_string()
}

/// A script's command lines: no comments, no blank lines.
fn commands(script: &str) -> Vec<&str> {
    script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// Whether `line` runs `cmd` as its command (followed by nothing, arguments or redirections).
fn runs(line: &str, cmd: &str) -> bool {
    line.strip_prefix(cmd)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '>', '<', '&', ';']))
}

#[test]
fn ci_runs_exactly_the_readme_test_command() {
    let cmd = test_command(&readme());
    let ci = std::fs::read_to_string(repo_root().join(".ci/run")).expect(".ci/run");
    let lines = commands(&ci);
    // Besides the shell's own preamble, .ci/run is the one command.
    let rest: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| *l != "set -euo pipefail" && *l != "cd \"$(dirname \"$0\")/..\"")
        .collect();
    assert_eq!(
        rest,
        [format!("exec {cmd}").as_str()],
        ".ci/run must run exactly the README's test command {cmd:?}:\n{ci}"
    );
}

#[test]
fn the_fresh_machine_check_runs_the_readme_run_command() {
    let cmd = run_command(&readme());
    assert_eq!(
        cmd, "scripts/run",
        "the tour's restart line assumes this command"
    );
    let script = std::fs::read_to_string(repo_root().join("scripts/fresh-machine"))
        .expect("scripts/fresh-machine");
    assert!(
        commands(&script).iter().any(|l| runs(l, &cmd)),
        "scripts/fresh-machine never runs the README's run command {cmd:?}"
    );
}

/// The tour as one bash script: the blocks in order, each `scripts/run ARGS` line a restart.
fn tour_script(text: &str) -> String {
    let blocks = sh_blocks(section(text, TOUR));
    assert!(blocks.len() >= 4, "the tour has {} sh blocks", blocks.len());
    let run = run_command(text);
    let mut s = String::from(
        r#"set -euo pipefail
ip link set lo up
cd "$HOME"
start_nacred() {
    nacred "$@" >>"$NACRED_LOG" 2>&1 &
    NACRED_PID=$!
    for _ in $(seq 300); do
        nacre volume list >/dev/null 2>&1 && return 0
        kill -0 "$NACRED_PID" 2>/dev/null || { echo "nacred $* exited during start" >&2; return 1; }
        sleep 0.1
    done
    echo "nacred $* did not answer within 30 s" >&2
    return 1
}
restart_nacred() {
    kill -TERM "$NACRED_PID"
    wait "$NACRED_PID" || true
    start_nacred "$@"
}
stop_all() {
    local p
    for p in $(jobs -p); do kill -TERM "$p" 2>/dev/null || true; done
    wait || true
}
trap stop_all EXIT
start_nacred
set -x
"#,
    );
    for block in blocks {
        for line in block.lines() {
            match line.strip_prefix(run.as_str()) {
                Some(args) if runs(line, &run) => {
                    s.push_str(&format!("restart_nacred{args}\n"));
                }
                _ => {
                    s.push_str(line);
                    s.push('\n');
                }
            }
        }
    }
    s
}

#[test]
fn the_readme_tour_runs_as_written() {
    let text = readme();
    let script = tour_script(&text);
    assert!(
        script.contains("restart_nacred --host-listen"),
        "the tour restarts nacred with the host channel on:\n{script}"
    );

    let tmp = tempfile::Builder::new()
        .prefix("nacre-readme-")
        .tempdir()
        .expect("tempdir");
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let driver = tmp.path().join("tour.sh");
    std::fs::write(&driver, &script).unwrap();
    let log = tmp.path().join("nacred.log");

    // The freshly built binaries (nacred, nacre, nacre-host), before anything else on PATH.
    let bin_dir = bin("nacred").parent().unwrap().to_path_buf();
    bin("nacre");
    bin("nacre-host");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );

    let root = is_root();
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "10", "240", "unshare", "--net"]);
    if !root {
        // A user namespace lets an unprivileged run make its network namespace.
        cmd.arg("--map-root-user");
    }
    cmd.arg("bash")
        .arg(&driver)
        .current_dir(&home)
        .env("PATH", path)
        .env("HOME", &home)
        .env("TMPDIR", tmp.path())
        .env("NACRED_LOG", &log)
        .env("NACRE_STATE_DIR", tmp.path().join("state"))
        .env("NACRE_RUN_DIR", tmp.path().join("run"))
        .env_remove("NACRE_RPC")
        .env_remove("NACRE_NVMF_LISTEN")
        .env_remove("NACRE_METRICS_LISTEN")
        .env_remove("NACRE_HOST_LISTEN")
        .env_remove("NACRE_HOST_TLS_DIR")
        .env_remove("NACRE_HOST_DIR")
        .env_remove("NACRE_HOST_DPU")
        .stdin(Stdio::null());
    let out = cmd.output().expect("run the tour (timeout, unshare, bash)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let nacred_log = std::fs::read_to_string(&log).unwrap_or_default();
    let shelf_log = std::fs::read_to_string(home.join("shelf.log")).unwrap_or_default();
    let report = format!(
        "the README's tour failed ({}):\n--- output ---\n{stdout}\n--- commands and errors ---\n{stderr}\n\
         --- nacred ---\n{nacred_log}\n--- the shelf ---\n{shelf_log}",
        out.status
    );
    assert!(out.status.success(), "{report}");
    println!("{stdout}");
    // What the tour shows: the encrypted volumes, the attached shelf, the paired host.
    for want in ["secret", "far", "shelf1", "live", "node17"] {
        assert!(
            stdout.contains(want),
            "the tour's output lacks {want:?}:\n{report}"
        );
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
