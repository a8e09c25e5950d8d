//! The `nacre` CLI as an operator meets it: help that teaches, one-line errors, tables and
//! JSON that match what nacred holds.

use nacre_tests::daemon::{bin, Nacred};
use serde_json::Value;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn help_teaches_with_examples() {
    for args in [
        vec!["--help"],
        vec!["volume", "create", "--help"],
        vec!["vhost-blk", "create", "--help"],
    ] {
        let out = std::process::Command::new(bin("nacre"))
            .args(&args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        let s = text(&out.stdout);
        assert!(s.contains("Examples:"), "{args:?}: {s}");
    }
    let out = std::process::Command::new(bin("nacred"))
        .arg("--help")
        .output()
        .unwrap();
    let s = text(&out.stdout);
    assert!(s.contains("--state-dir") && s.contains("NACRE_STATE_DIR") && s.contains("Examples:"));
}

#[test]
fn unreachable_daemon_is_one_clear_line() {
    let out = std::process::Command::new(bin("nacre"))
        .args(["--rpc", "/nonexistent/nacred.sock", "volume", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        e.contains("cannot reach nacred at /nonexistent/nacred.sock"),
        "{e}"
    );
    assert!(e.contains("NACRE_RPC"), "{e}");
}

#[test]
fn volume_and_device_workflow() {
    let n = Nacred::start_args(&["--no-default"]);
    let out = n.cli(&[
        "volume",
        "create",
        "data",
        "--size",
        "64M",
        "--block-size",
        "512",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("created volume data (64M, file"));
    let v = n.ok("volume_list", Value::Null);
    assert_eq!(v[0]["size"], 64 << 20);
    assert_eq!(v[0]["block_size"], 512);

    let out = n.cli(&[
        "vhost-blk",
        "create",
        "d0",
        "--volume",
        "data",
        "--queues",
        "2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = n.cli(&["volume", "list"]);
    let s = text(&out.stdout);
    let header = s.lines().next().unwrap();
    assert!(
        header.starts_with("NAME") && header.contains("EXPORTED BY"),
        "{s}"
    );
    assert!(s.lines().nth(1).unwrap().contains("vhost-blk:d0"), "{s}");

    let out = n.cli(&["--json", "vhost-blk", "list"]);
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j[0]["queues"], 2);

    let out = n.cli(&["volume", "delete", "data"]);
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert_eq!(e.lines().count(), 1);
    assert!(
        e.starts_with("nacre: error: volume \"data\" is exported by vhost-blk:d0"),
        "{e}"
    );

    let out = n.cli(&["volume", "resize", "data", "--size", "128M"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(n.ok("volume_list", Value::Null)[0]["size"], 128 << 20);

    let out = n.cli(&["rpc", "volume_list", r#"{"name": "data"}"#]);
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j[0]["name"], "data");
    let out = n.cli(&["rpc", "volume_list", "{oops"]);
    assert!(text(&out.stderr).contains("params are not valid JSON"));
}

#[test]
fn bad_arguments_are_refused_before_any_rpc() {
    let n = Nacred::start_args(&["--no-default"]);
    for (args, needle) in [
        (
            vec!["volume", "create", "x", "--size", "12Q"],
            "invalid size",
        ),
        (
            vec![
                "volume",
                "create",
                "x",
                "--size",
                "1G",
                "--block-size",
                "1024",
            ],
            "512 or 4096",
        ),
        (
            vec!["volume", "create", "x", "--size", "1G", "--backend", "tape"],
            "unknown backend",
        ),
        (
            vec!["volume", "create", "x", "--size", "1G", "--encrypt"],
            "--tenant",
        ),
    ] {
        let out = n.cli(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains(needle),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    assert!(n
        .ok("volume_list", Value::Null)
        .as_array()
        .unwrap()
        .is_empty());
}

fn nacre(args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin("nacre"))
        .args(args)
        .env_remove("NACRE_RPC")
        .output()
        .unwrap()
}

#[test]
fn the_first_line_of_help_is_nacres_own() {
    let out = nacre(&["--help"]);
    let s = text(&out.stdout);
    assert!(
        s.lines().next().unwrap().starts_with("Operate nacred"),
        "{s}"
    );
    assert!(!s.contains("daemon, and its library"), "{s}");
}

#[test]
fn nvmf_namespace_and_listener_help_describe_every_argument_with_examples() {
    for (cmd, needles) in [
        ("add-ns", vec!["Subsystem NQN", "The volume to export"]),
        (
            "add-listener",
            vec![
                "Subsystem NQN",
                "IPv4 or IPv6 address",
                "TCP port",
                "tcp or rdma",
                "--transport rdma",
                "--transport vfio-user --path",
            ],
        ),
    ] {
        let s = text(&nacre(&["nvmf", cmd, "--help"]).stdout);
        assert!(s.contains("Examples:\n  nacre nvmf"), "{cmd}: {s}");
        for n in needles {
            assert!(s.contains(n), "{cmd} --help lacks {n:?}:\n{s}");
        }
    }
}

#[test]
fn command_line_errors_are_one_line_starting_nacre() {
    for (args, needle) in [
        (vec!["volume", "creat"], "unrecognized subcommand 'creat'"),
        (vec!["volume", "create"], "required arguments"),
        (
            vec!["volume", "create", "x", "--size", "1G", "--bogus"],
            "unexpected argument '--bogus'",
        ),
        (
            vec!["volume", "create", "x", "--size", "-5G"],
            "a size cannot be negative",
        ),
        (
            vec!["volume", "resize", "x", "--size", "-1"],
            "a size cannot be negative",
        ),
        // Once a panic ("cannot convert float seconds to Duration").
        (
            vec!["top", "--interval", "1e20"],
            "between 0.1 and 3600 seconds",
        ),
        (vec!["top", "--interval", "NaN"], "between 0.1 and 3600"),
    ] {
        let out = nacre(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let e = text(&out.stderr);
        assert_eq!(e.lines().count(), 1, "{args:?}: {e}");
        assert!(
            e.starts_with("nacre: error: ") && e.contains(needle),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn an_unreachable_daemon_names_the_os_error_once() {
    let out = nacre(&["--rpc", "/nonexistent/nacred.sock", "volume", "list"]);
    let e = text(&out.stderr);
    assert_eq!(e.matches("os error 2").count(), 1, "{e}");
}

#[test]
fn methods_prints_whole_descriptions_and_vhost_blk_defaults_to_four_queues() {
    let n = Nacred::start_args(&["--no-default"]);
    let out = n.cli(&["methods"]);
    let s = text(&out.stdout);
    let attach = s
        .lines()
        .find(|l| l.starts_with("remote_attach "))
        .unwrap_or_else(|| panic!("{s}"));
    assert!(
        !attach.contains('…') && attach.trim_end().ends_with("quiesce_time_ms."),
        "{attach}"
    );
    // One column for the names, as wide as the longest.
    let col = |l: &str| {
        l.find("  ")
            .map(|i| i + l[i..].len() - l[i..].trim_start().len())
    };
    let cols: std::collections::BTreeSet<_> = s.lines().filter_map(col).collect();
    assert_eq!(cols.len(), 1, "{s}");

    n.ok(
        "volume_create",
        serde_json::json!({"name": "v", "size": 1 << 20, "backend": "ram"}),
    );
    let out = n.cli(&["vhost-blk", "create", "d", "--volume", "v"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(n.ok("vhost_blk_list", Value::Null)[0]["queues"], 4);
}

#[test]
fn disk_check_reads_the_default_disk_through_both_frontends() {
    let n = Nacred::start();
    // Something on the disk, so that "the same bytes" is not only zeros.
    let img = n.state_dir.join("volumes/default.img");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&[0x5a; 4096], 8192).unwrap();
        f.write_all_at(&[0xc3; 4096], (1 << 30) - 4096).unwrap();
    }
    let subs = n.ok("nvmf_get_subsystems", Value::Null);
    let listener = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == "nqn.2014-08.io.nacre:default")
        .unwrap()["listeners"][0]
        .as_str()
        .unwrap()
        .to_string();
    let out = std::process::Command::new(bin("disk-check"))
        .arg("--run-dir")
        .arg(&n.run_dir)
        .args(["--nvmf", &listener])
        .output()
        .unwrap();
    let s = text(&out.stdout);
    assert!(
        out.status.success() && s.contains("OK: the default disk answers"),
        "{s}\n{}",
        text(&out.stderr)
    );
    // It read and never wrote.
    let mut tail = vec![0u8; 4096];
    use std::os::unix::fs::FileExt;
    std::fs::File::open(&img)
        .unwrap()
        .read_exact_at(&mut tail, (1 << 30) - 4096)
        .unwrap();
    assert_eq!(tail, vec![0xc3; 4096]);
    // Against nothing: one line, exit 1.
    let out = std::process::Command::new(bin("disk-check"))
        .args(["--run-dir", "/nonexistent"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr).lines().count(),
        1,
        "{}",
        text(&out.stderr)
    );
}

/// The man pages and completions the Debian packages install (scripts/package) come from the
/// hidden `generate-docs` of nacre (nacre's and nacred's) and nacre-host: a page per command
/// and subcommand, nacred's in section 8, three shells; the subcommand stays out of help.
#[test]
fn generate_docs_writes_every_page_and_completion_and_stays_hidden() {
    let dir = tempfile::tempdir().unwrap();
    for program in ["nacre", "nacre-host"] {
        let out = std::process::Command::new(bin(program))
            .args(["generate-docs", "--out"])
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{program} generate-docs: {}",
            text(&out.stderr)
        );
        let help = std::process::Command::new(bin(program))
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            !text(&help.stdout).contains("generate-docs"),
            "{program} --help shows the packaging subcommand"
        );
    }
    let man = dir.path().join("man");
    for page in [
        "nacre.1",
        "nacre-volume.1",
        "nacre-volume-create.1",
        "nacre-vhost-blk-create.1",
        "nacre-nvmf-add-listener.1",
        "nacre-tenant-policy-set.1",
        "nacred.8",
        "nacre-host.1",
        "nacre-host-image-build.1",
    ] {
        let p = man.join(page);
        let body = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(
            body.starts_with(".ie"),
            "{page} is not a roff page: {body:.80}"
        );
    }
    let nacred = std::fs::read_to_string(man.join("nacred.8")).unwrap();
    assert!(nacred.contains("state\\-dir") && nacred.contains("/var/lib/nacre"));
    let pages = std::fs::read_dir(&man).unwrap().count();
    assert!(pages > 60, "only {pages} man pages");
    for program in ["nacre", "nacred", "nacre-host"] {
        for rel in [
            format!("bash/{program}"),
            format!("zsh/_{program}"),
            format!("fish/{program}.fish"),
        ] {
            let p = dir.path().join("completions").join(rel);
            let body =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert!(
                body.contains(program),
                "{} does not name {program}",
                p.display()
            );
        }
    }
    let bash = std::fs::read_to_string(dir.path().join("completions/bash/nacre")).unwrap();
    assert!(bash.contains("vhost-blk") && !bash.contains("generate-docs"));
}
