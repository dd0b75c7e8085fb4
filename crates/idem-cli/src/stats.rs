//! `idem stats`: how many keys each state holds.

use idem_core::{KeyAdmin, TimeSource};

use crate::output::{Failure, print};
use crate::store::{KeysTable, with_table};

/// The flags of `idem stats`.
#[derive(Debug, clap::Args)]
pub(crate) struct StatsArgs {
    #[command(flatten)]
    at: KeysTable,
}

/// Counts the keys by state, by the store's clock.
pub(crate) async fn run(args: StatsArgs, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let s = args.at.open(redis).await?;
    let now = s.source_now_ms().await?;
    let st = s.stats(now).await?;
    let v = with_table(
        &s,
        serde_json::json!({
            "store": s.kind(),
            "in_progress": st.in_progress,
            "completed": st.completed,
            "rejected": st.rejected,
            "unknown": st.unknown,
            "sent": st.sent,
            "expired": st.expired,
        }),
    );
    print(
        json,
        v,
        format!(
            "{}: {} in progress, {} sent (may have reached the other side), {} completed, {} rejected, {} unknown \
             (held for an operator), {} expired (to sweep)",
            s.kind(),
            st.in_progress,
            st.sent,
            st.completed,
            st.rejected,
            st.unknown,
            st.expired
        ),
    );
    Ok(())
}
