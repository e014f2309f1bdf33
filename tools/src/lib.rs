//! What the tools share: the geometry flags of the two-process tools (kvstage-demo,
//! kvstage-bench), progress bars on stderr, and JSON output.

use std::io::IsTerminal;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvstage::engine::TransportKind;
use kvstage::geometry::{LayoutPreset, ModelKind};
use kvstage::session::stats::LinkKind;
use kvstage::Error;
use kvstage_testkit::cluster::{Prefill, Setup};
use kvstage_testkit::{model, MODELS};

/// The `q` quantile (0..=1) of `sorted` (ascending, not empty): the nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The kvstage library's version, `MAJOR.MINOR.PATCH`.
pub fn library_version() -> String {
    let v = kvstage::version_number();
    format!("{}.{}.{}", v >> 16, (v >> 8) & 0xff, v & 0xff)
}

/// `--kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    /// Multi-head (or grouped-query) attention: K and V per layer.
    Mha,
    /// Multi-head latent attention: one latent buffer per layer.
    Mla,
}

/// The geometry both processes share (the test kit's [`Setup`]), as flags. The decode child
/// process receives the same flags ([`Setup::flags`]).
#[derive(clap::Args, Clone, Debug)]
pub struct SetupArgs {
    /// Model shape preset; `custom`: the tool's default preset changed by the shape flags below
    /// (any of which also makes the shape `custom`).
    #[arg(long, value_parser = model_names(), default_value = "llama3-70b")]
    pub model: String,
    /// Attention kind (overrides the preset).
    #[arg(long, value_enum)]
    pub kind: Option<Kind>,
    /// Layers (overrides the preset).
    #[arg(long, value_name = "N")]
    pub layers: Option<u32>,
    /// KV heads of the whole model (overrides the preset).
    #[arg(long, value_name = "N")]
    pub kv_heads: Option<u32>,
    /// Elements per head (overrides the preset).
    #[arg(long, value_name = "N")]
    pub head_dim: Option<u32>,
    /// Elements per V head where V's heads differ in size from K's (default: `--head-dim`).
    #[arg(long, value_name = "N")]
    pub head_dim_v: Option<u32>,
    /// Bytes per element (overrides the preset).
    #[arg(long, value_name = "N")]
    pub dtype_bytes: Option<u32>,
    /// Prefill tensor-parallel size (this process plays every prefill rank).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub prefill_tp: u32,
    /// Decode tensor-parallel size (the child process plays every decode rank).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub decode_tp: u32,
    /// Tokens per page.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub page_size: u32,
    /// Tokens per request.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub tokens: u32,
    /// Tokens per chunk (the decode chunk grid).
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub chunk_tokens: u32,
    /// Decode staging ring size, in chunk allocations.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub ring_chunks: u32,
    /// Transport of every engine on both sides: `rdma` fails without a usable device and `shm`
    /// between engines on different hosts (no quiet fallback); `auto` takes the same-host path,
    /// else RDMA where both sides can, else TCP.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: Transport,
    /// Aux buffers (metadata rows of 64 to 512 bytes) each request also moves, one row each.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub aux_rows: u32,
    /// Bytes of per-request state (one state component over every layer, sharded by TP) each
    /// request also moves.
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    pub state_bytes: u64,
    /// Same-host sessions through the decode ring (gather, ring, scatter) instead of direct mode,
    /// where the prefill copies each chunk from its pages into the decode pool's pages (the
    /// decode pools then lie in shared memory).
    #[arg(long)]
    pub no_direct: bool,
    /// Pool layouts as engines keep them, prefill[:decode] (sglang, vllm-lbhnc, vllm-lbnhc,
    /// vllm-lhbnc, vllm-blhnc, vllm-blnhc, vllm-bhlnc, trtllm); the decode side defaults to the
    /// prefill's. Only the model crosses the wire: any layout sends to any other.
    #[arg(long, value_name = "P[:D]", value_parser = layout_pair)]
    pub layout: Option<(LayoutPreset, LayoutPreset)>,
    /// The prefill pools' layout alone (overrides --layout's).
    #[arg(long, value_name = "NAME", value_parser = layout_name)]
    pub prefill_layout: Option<LayoutPreset>,
    /// The decode pools' layout alone (overrides --layout's).
    #[arg(long, value_name = "NAME", value_parser = layout_name)]
    pub decode_layout: Option<LayoutPreset>,
    /// Bytes of padding after every page (block) of both sides' pools (vLLM's `page_size_padded`).
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    pub page_pad: u64,
}

fn layout_name(v: &str) -> Result<LayoutPreset, String> {
    LayoutPreset::from_name(v).map_err(|e| e.message().to_owned())
}

/// `P[:D]`: a layout per side, the decode side's defaulting to the prefill's.
pub fn layout_pair(v: &str) -> Result<(LayoutPreset, LayoutPreset), String> {
    let (p, d) = v.split_once(':').unwrap_or((v, v));
    Ok((layout_name(p)?, layout_name(d)?))
}

/// `--transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    Tcp,
    Rdma,
    Shm,
    Auto,
}

fn model_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(MODELS.iter().map(|m| m.name).chain(["custom"]))
}

impl SetupArgs {
    /// The setup these flags describe; `default_model` is the base of `--model custom`.
    pub fn setup(&self, default_model: &str) -> Result<Setup, String> {
        let name = if self.model == "custom" { default_model } else { &self.model };
        let mut m = model(name).ok_or_else(|| format!("unknown model '{name}'"))?;
        if self.model == "custom" {
            m.name = "custom";
        }
        let shape = [
            (self.layers, &mut m.layers),
            (self.kv_heads, &mut m.kv_heads),
            (self.head_dim, &mut m.head_dim),
            (self.head_dim_v, &mut m.head_dim_v),
            (self.dtype_bytes, &mut m.dtype_bytes),
        ];
        let mut custom = false;
        for (value, field) in shape {
            if let Some(v) = value {
                *field = v;
                custom = true;
            }
        }
        if let Some(kind) = self.kind {
            m.kind = match kind {
                Kind::Mha => ModelKind::Mha,
                Kind::Mla => ModelKind::Mla,
            };
            custom = true;
        }
        if custom {
            m.name = "custom";
        }
        let setup = Setup {
            model: m,
            prefill_tp: self.prefill_tp,
            decode_tp: self.decode_tp,
            page_size: self.page_size,
            tokens: self.tokens,
            chunk_tokens: self.chunk_tokens,
            ring_chunks: self.ring_chunks,
            transport: match self.transport {
                Transport::Tcp => TransportKind::Tcp,
                Transport::Rdma => TransportKind::Rdma,
                Transport::Shm => TransportKind::Shm,
                Transport::Auto => TransportKind::Auto,
            },
            aux_rows: self.aux_rows,
            state_bytes: self.state_bytes,
            direct: !self.no_direct,
            prefill_layout: self.prefill_layout.or(self.layout.map(|l| l.0)).unwrap_or(LayoutPreset::Sglang),
            decode_layout: self.decode_layout.or(self.layout.map(|l| l.1)).unwrap_or(LayoutPreset::Sglang),
            page_pad: self.page_pad,
        };
        setup.check()?;
        Ok(setup)
    }
}

/// Parses the command line into `T` with these defaults (argument id, value): the tools share
/// [`SetupArgs`] but not all of its defaults. Exits like clap on an error or `--help`.
pub fn parse_with_defaults<T: Parser>(defaults: &[(&'static str, &'static str)]) -> T {
    let mut matches = with_defaults(T::command(), defaults).get_matches();
    T::from_arg_matches_mut(&mut matches).unwrap_or_else(|e| e.exit())
}

fn with_defaults(mut cmd: clap::Command, defaults: &[(&'static str, &'static str)]) -> clap::Command {
    for &(id, value) in defaults {
        cmd = cmd.mut_arg(id, |a| a.default_value(value));
    }
    cmd
}

/// Exits with clap's usage error (status 2) for a check clap cannot express.
pub fn usage_error<T: CommandFactory>(message: impl std::fmt::Display) -> ! {
    T::command().error(clap::error::ErrorKind::ValueValidation, message).exit()
}

/// A progress bar of `len` steps on stderr; drawn only when stderr is a terminal.
pub fn progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), draw_target());
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg:24} {elapsed}").expect("valid template").progress_chars("#>."),
    );
    bar
}

/// A spinner with `message` on stderr; drawn only when stderr is a terminal.
pub fn spinner(message: String) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, draw_target());
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"));
    bar.set_message(message);
    if !bar.is_hidden() {
        bar.enable_steady_tick(Duration::from_millis(100));
    }
    bar
}

fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// `tcp`, `rdma` or `shm`: how a session's chunks move.
pub fn link_name(link: LinkKind) -> &'static str {
    match link {
        LinkKind::Tcp => "tcp",
        LinkKind::Rdma => "rdma",
        LinkKind::Shm => "shm",
    }
}

/// The links the sender sessions of a prefill side ended up on (from their stats), whatever
/// `--transport` asked: with `auto` this is what the engines chose.
#[derive(Clone, Debug, Default)]
pub struct Links {
    /// Per sender session, prefill rank by prefill rank: its id (`p{rank}-d{rank}`) and link.
    pub sessions: Vec<(String, LinkKind)>,
    /// Sessions that were allowed a faster path (transport auto) and run on a slower one.
    pub downgraded: usize,
    /// The prefill engines' last same-host downgrade (why `auto` did not take shm), if any.
    pub shm_downgrade: Option<String>,
    /// Sessions in direct mode (the prefill maps the decode pool) and the chunk regions they
    /// copied page to page, over the prefill engines.
    pub direct_sessions: u64,
    pub direct_chunks: u64,
}

impl Links {
    pub fn of(prefill: &Prefill) -> Links {
        let mut links = Links::default();
        for r in &prefill.ranks {
            for session in &r.sessions {
                let stats = session.stats();
                links.sessions.push((session.id().to_owned(), stats.link));
                links.downgraded += usize::from(stats.downgraded);
            }
            let shm = r.engine.shm();
            let why = shm.last_downgrade();
            if !why.is_empty() {
                links.shm_downgrade = Some(why);
            }
            links.direct_sessions += shm.direct_sessions();
            links.direct_chunks += shm.direct_chunks();
        }
        links
    }

    /// How the staged chunks went: `shm-direct` (every session copies page to page), `shm-ring`
    /// (through the decode ring), else the common link (`tcp`, `rdma`, `mixed`).
    pub fn path(&self) -> &'static str {
        match self.common() {
            "shm" if self.direct_sessions == self.sessions.len() as u64 => "shm-direct",
            "shm" if self.direct_sessions == 0 => "shm-ring",
            "shm" => "mixed",
            link => link,
        }
    }

    /// Each session's link name, in session order.
    pub fn names(&self) -> Vec<&'static str> {
        self.sessions.iter().map(|(_, l)| link_name(*l)).collect()
    }

    /// The one link every session is on, or `mixed` (`none` without sessions).
    pub fn common(&self) -> &'static str {
        match self.sessions.split_first() {
            None => "none",
            Some(((_, first), rest)) if rest.iter().all(|(_, l)| l == first) => link_name(*first),
            Some(_) => "mixed",
        }
    }

    /// Whether every session is on `link`.
    pub fn all(&self, link: LinkKind) -> bool {
        !self.sessions.is_empty() && self.sessions.iter().all(|(_, l)| *l == link)
    }

    /// `shm (4 sessions)`, or `shm (2 sessions), tcp (2 sessions)`; `, 4 direct` when same-host
    /// sessions copy page to page.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        for link in [LinkKind::Shm, LinkKind::Rdma, LinkKind::Tcp] {
            let n = self.sessions.iter().filter(|(_, l)| *l == link).count();
            if n > 0 {
                parts.push(format!("{} ({n} session{})", link_name(link), if n == 1 { "" } else { "s" }));
            }
        }
        if self.direct_sessions > 0 {
            parts.push(format!("{} direct (decode pool mapped)", self.direct_sessions));
        }
        if parts.is_empty() {
            "no sessions".to_owned()
        } else {
            parts.join(", ")
        }
    }
}

/// `value` as pretty-printed JSON (with a final newline).
pub fn json<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string_pretty(value).expect("plain data serializes") + "\n"
}

/// Writes `value` as JSON to `path`.
pub fn write_json<T: serde::Serialize + ?Sized>(path: &str, value: &T) -> Result<(), Error> {
    std::fs::write(path, json(value)).map_err(|e| Error::internal(format!("cannot write {path}")).with_source(e))
}

#[cfg(test)]
mod tests {
    use clap::FromArgMatches;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        setup: SetupArgs,
    }

    fn parse(args: &[&str]) -> Result<Setup, String> {
        let mut cmd = with_defaults(Cli::command(), &[("model", "llama3-70b"), ("tokens", "2048")]);
        let mut m = cmd.try_get_matches_from_mut(std::iter::once("t").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        Cli::from_arg_matches_mut(&mut m).map_err(|e| e.to_string())?.setup.setup("llama3-70b")
    }

    /// Everything but the model's name.
    fn key(s: &Setup) -> (ModelKind, [u32; 11]) {
        let m = &s.model;
        (m.kind, [m.layers, m.kv_heads, m.head_dim, m.head_dim_v, m.dtype_bytes, s.prefill_tp, s.decode_tp, s.page_size, s.tokens, s.chunk_tokens, s.ring_chunks])
    }

    #[test]
    fn flags_round_trip_through_the_child_command_line() {
        for args in [
            &["--model", "deepseek-v3", "--prefill-tp", "2", "--decode-tp", "8"][..],
            &["--layers", "2", "--kv-heads", "4", "--head-dim", "16", "--head-dim-v", "8", "--page-size", "4", "--tokens", "64"],
            &["--model", "custom", "--kind", "mla", "--kv-heads", "1"],
        ] {
            let s = parse(args).unwrap();
            let again = parse(&s.flags().iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
            assert_eq!(key(&again), key(&s), "{args:?}");
        }
        let s = parse(&[]).unwrap();
        assert_eq!((s.model.name, s.tokens, s.prefill_tp, s.decode_tp, s.page_size, s.ring_chunks), ("llama3-70b", 2048, 4, 2, 16, 2));
        assert_eq!(parse(&["--layers", "3"]).unwrap().model.name, "custom");
        assert!(parse(&["--tokens", "10"]).unwrap_err().contains("multiple of --page-size"));
        assert!(parse(&["--model", "gpt"]).is_err());
        Cli::command().debug_assert();
    }
}
