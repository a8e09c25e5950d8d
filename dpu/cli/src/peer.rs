//! `nacre peer ...`: GPU peer windows hosts registered (`nacre-host register-gpu`).

use anyhow::Result;
use clap::Subcommand;
use nacre_shared::api::peer::PeerWindowInfo;
use nacre_shared::size::format_size;
use serde_json::json;

use super::Ctx;
use nacre_shared::table::Table;

#[derive(Subcommand, Debug)]
pub enum PeerCmd {
    /// List GPU memory windows registered for the zero-copy RDMA path.
    #[command(
        after_help = "Examples:\n  nacre peer list\n  nacre peer list --tenant acme --json\n\nWindows live as long as the host channel that registered them."
    )]
    List {
        /// Only this tenant's windows.
        #[arg(long)]
        tenant: Option<String>,
    },
}

pub fn run(ctx: &mut Ctx, cmd: PeerCmd) -> Result<()> {
    match cmd {
        PeerCmd::List { tenant } => {
            let p = match tenant {
                Some(t) => json!({ "tenant": t }),
                None => json!({}),
            };
            let v = ctx.call("peer_window_list", p)?;
            ctx.print(&v, |v| {
                let ws: Vec<PeerWindowInfo> = serde_json::from_value(v.clone()).unwrap_or_default();
                let mut t = Table::new(&[
                    "ID", "TENANT", "HOST", "GPU", "BDF", "LENGTH", "BAR1", "HANDLE",
                ]);
                for w in ws {
                    t.row(vec![
                        w.id.to_string(),
                        w.tenant,
                        w.host,
                        w.gpu_uuid,
                        w.bdf,
                        format_size(w.length),
                        format!("{:#x}+{}", w.bar1_start, format_size(w.bar1_len)),
                        match w.handle {
                            Some(h) => format!("{}:{h}", w.handle_kind),
                            None => w.handle_kind,
                        },
                    ]);
                }
                t.print();
            });
            Ok(())
        }
    }
}
