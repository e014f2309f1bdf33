//! `--layer-ms X`: whole-chunk against layer-wise sending behind a simulated prefill that finishes
//! one layer every X ms (the first layer starts when the request does). The figure is the
//! **exposed time**: from the last layer being ready to the decode side's scatter done — what the
//! transfer adds to time-to-first-token.
//!
//! whole      the request's transfers are submitted when the last layer is ready
//! layerwise  they are submitted when the request starts; each layer is marked ready on every
//!            operation as the timer reaches it

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvstage::{Error, Status};
use kvstage_testkit::cluster::{DecodeChild, Prefill};
use serde::Serialize;

use crate::report::{ratio, Check, Section};
use crate::{prefill_options, spawn_child, Args, TRANSFER_TIMEOUT};

/// The `--json` report of `--layer-ms`.
#[derive(Serialize)]
pub struct LayersJson {
    layer_ms: f64,
    layers: u32,
    /// Bytes of one request (every decode rank).
    bytes: u64,
    reps: u32,
    /// Medians of the exposed times, and layerwise / whole.
    exposed: Exposed,
    /// Decode bytes of the last request of each kind compared with the reference, and equal.
    verified_whole: bool,
    verified_layerwise: bool,
}

#[derive(Serialize)]
struct Exposed {
    whole_s: f64,
    layerwise_s: f64,
    ratio: f64,
    whole_samples: Vec<f64>,
    layerwise_samples: Vec<f64>,
}

/// One request, after `warmup` untimed ones of each kind, `reps` times each kind (alternating,
/// so that both see the same machine).
pub fn layer_stream(a: &Args, layer_ms: f64) -> Result<(String, LayersJson), Error> {
    let s = &a.setup;
    if s.has_parts() {
        return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "--layer-ms: request parts travel with whole chunks (drop --aux-rows and --state-bytes)"));
    }
    let mut child = spawn_child(a, None)?;
    let prefill = Prefill::connect_with(s, &child.addrs, &prefill_options(a))?;
    let link = kvstage_tools::Links::of(&prefill).common();
    let layers = s.model.layers;
    let layer = Duration::from_secs_f64(layer_ms.max(0.0) / 1e3);
    let bytes = s.room_bytes()?;
    let bar = kvstage_tools::progress(2 * (a.warmup + a.reps) as u64);
    let (mut whole, mut layerwise) = (Section::new(bytes), Section::new(bytes));
    let (mut check_whole, mut check_layerwise) = (Check::NotChecked, Check::NotChecked);
    let mut room = 0u64;
    for rep in 0..a.warmup + a.reps {
        for layer_wise in [false, true] {
            room += 1;
            let last = rep + 1 == a.warmup + a.reps;
            let (exposed, check) = request(&mut child, &prefill, a, room, layers, layer, layer_wise, last)?;
            if rep >= a.warmup {
                if layer_wise { &mut layerwise } else { &mut whole }.samples.push(exposed);
            }
            if let Some(c) = check {
                *if layer_wise { &mut check_layerwise } else { &mut check_whole } = c;
            }
            bar.set_message(if layer_wise { "layerwise" } else { "whole" });
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    drop(prefill);
    child.quit()?;
    let compute = layer.as_secs_f64() * layers as f64;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "layer-wise sending: {} over {link}, P{}-D{}, {} tokens, {layers} layers, one layer every {layer_ms} ms ({compute:.3} s of prefill), {} MiB per request, {} reps",
        s.model.name,
        s.prefill_tp,
        s.decode_tp,
        s.tokens,
        bytes >> 20,
        a.reps
    );
    let _ = writeln!(text, "exposed time (last layer ready -> decode scatter done), median:");
    let _ = writeln!(text, "  whole chunk  {:>9.4} s   (decode bytes: {})", whole.median(), check_whole.text());
    let _ = writeln!(text, "  layer-wise   {:>9.4} s   (decode bytes: {})", layerwise.median(), check_layerwise.text());
    let r = ratio(layerwise.median(), whole.median());
    let _ = writeln!(text, "  layer-wise / whole = {r:.3} (target <= 0.15 when a layer's compute takes at least a layer's transfer)");
    let json = LayersJson {
        layer_ms,
        layers,
        bytes,
        reps: a.reps,
        exposed: Exposed { whole_s: whole.median(), layerwise_s: layerwise.median(), ratio: r, whole_samples: whole.samples, layerwise_samples: layerwise.samples },
        verified_whole: check_whole.verified(),
        verified_layerwise: check_layerwise.verified(),
    };
    let ok = check_whole.verified() && check_layerwise.verified();
    if !ok {
        return Err(Error::internal(format!("decode bytes differ from the reference:\n{text}")));
    }
    Ok((text, json))
}

/// One request behind the simulated prefill; its exposed time, and with `verify` the check of
/// its decode bytes.
#[allow(clippy::too_many_arguments)]
fn request(
    child: &mut DecodeChild,
    prefill: &Prefill,
    a: &Args,
    room: u64,
    layers: u32,
    layer: Duration,
    layer_wise: bool,
    verify: bool,
) -> Result<(f64, Option<Check>), Error> {
    let keys = child.open_room(room, None)?;
    child.watch(room)?;
    let t0 = Instant::now();
    let ready_at = |l: u32| t0 + layer * (l + 1);
    let ops = if layer_wise {
        let ops = prefill.submit_room(&a.setup, &keys, TRANSFER_TIMEOUT, true)?;
        for l in 0..layers {
            sleep_until(ready_at(l));
            for op in &ops {
                op.layers().expect("a layer-wise operation").mark(l, 1, None)?;
            }
        }
        ops
    } else {
        sleep_until(ready_at(layers - 1));
        prefill.submit_room(&a.setup, &keys, TRANSFER_TIMEOUT, false)?
    };
    // Both kinds count from the moment the simulated prefill finished its last layer.
    let last_ready = ready_at(layers - 1);
    let (done, at) = child.next_done()?;
    if done != room {
        return Err(Error::internal(format!("the decode process reported room {done}, expected {room}")));
    }
    for op in &ops {
        op.wait(Some(Duration::from_secs(60)))?;
    }
    let check = if verify { Some(Check::of(child.verify(room)?.0)) } else { None };
    child.command(&format!("release {room}"))?;
    Ok((at.saturating_duration_since(last_ready).as_secs_f64(), check))
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}
