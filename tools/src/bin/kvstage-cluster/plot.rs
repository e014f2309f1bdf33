//! The plot: each request's transfer latency (log scale) at the time it arrived, fault windows
//! shaded, as a PNG written here (indexed colour, stored deflate blocks: no dependency).
//!
//! Legend: x is seconds since the arrivals began (a grid line every 10 s, labelled every 10, 30
//! or 60 s by the run's length), y is the transfer latency in milliseconds from 1 ms to 100 s
//! (grid lines at each power of ten, labelled);
//! blue dots are requests verified byte for byte, red crosses at the top failed ones, magenta
//! crosses corrupt ones, black crosses hung ones; a fault's window from its start to its end is
//! shaded in its kind's colour (decode-kill orange, link-down grey, prefill-stop yellow, loss
//! green, close-sessions cyan), with a band of the same colour along the top edge so that a short
//! one still shows.

use crate::faults::{Kind, Record};

const W: usize = 1200;
const H: usize = 480;
const LEFT: usize = 56;
const BOTTOM: usize = 24;
const TOP: usize = 12;

/// The palette: index → RGB.
const PALETTE: [[u8; 3]; 13] = [
    [255, 255, 255], // 0 background
    [0, 0, 0],       // 1 axes, text, hung
    [220, 220, 220], // 2 grid
    [30, 90, 200],   // 3 verified
    [210, 30, 30],   // 4 failed
    [200, 0, 200],   // 5 corrupt
    [255, 215, 170], // 6 decode-kill
    [200, 200, 200], // 7 link-down
    [250, 240, 150], // 8 prefill-stop
    [190, 235, 190], // 9 loss
    [170, 230, 240], // 10 close-sessions
    [130, 130, 130], // 11 band outline
    [255, 255, 255], // 12 spare
];

/// What to draw for one request: arrival second, latency in ms (verified), or its class.
pub enum Point {
    Verified { at: f64, ms: f64 },
    Failed { at: f64 },
    Corrupt { at: f64 },
    Hung { at: f64 },
}

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn set(&mut self, x: i64, y: i64, c: u8) {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            self.px[y as usize * W + x as usize] = c;
        }
    }

    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: u8) {
        for y in y0..=y1 {
            for x in x0..=x1 {
                self.set(x, y, c);
            }
        }
    }

    fn cross(&mut self, x: i64, y: i64, c: u8) {
        for d in -3..=3 {
            self.set(x + d, y + d, c);
            self.set(x + d, y - d, c);
        }
    }

    /// Text in a 3×5 font (digits, `m`, `s`, `.`), scaled by 2.
    fn text(&mut self, x: i64, y: i64, s: &str, c: u8) {
        for (i, ch) in s.chars().enumerate() {
            let rows = glyph(ch);
            for (r, bits) in rows.iter().enumerate() {
                for b in 0..3 {
                    if bits & (4 >> b) != 0 {
                        let (gx, gy) = (x + i as i64 * 8 + b * 2, y + r as i64 * 2);
                        self.rect(gx, gy, gx + 1, gy + 1, c);
                    }
                }
            }
        }
    }
}

fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        'm' => [0, 0, 7, 7, 5],
        's' => [0, 3, 4, 1, 6],
        '.' => [0, 0, 0, 0, 2],
        _ => [0; 5],
    }
}

fn kind_colour(k: Kind) -> u8 {
    match k {
        Kind::DecodeKill => 6,
        Kind::LinkDown => 7,
        Kind::PrefillStop => 8,
        Kind::Loss => 9,
        Kind::CloseSessions => 10,
    }
}

/// Draws the plot; `seconds` is the x range.
pub fn draw(points: &[Point], faults: &[Record], seconds: f64) -> Vec<u8> {
    let mut c = Canvas { px: vec![0; W * H] };
    let (pw, ph) = ((W - LEFT - 8) as f64, (H - BOTTOM - TOP) as f64);
    let seconds = seconds.max(1.0);
    let xof = |t: f64| LEFT as i64 + (t.clamp(0.0, seconds) / seconds * pw) as i64;
    // 1 ms .. 100 s, log scale.
    let yof = |ms: f64| TOP as i64 + ((1.0 - (ms.max(1.0).log10() / 5.0).min(1.0)) * ph) as i64;
    let (x_end, y_end) = (LEFT as i64 + pw as i64, TOP as i64 + ph as i64);
    for f in faults.iter().filter(|f| !f.skipped) {
        let (x0, x1) = (xof(f.start_s), xof(f.end_s.unwrap_or(seconds)).max(xof(f.start_s) + 2));
        c.rect(x0, TOP as i64, x1, y_end, kind_colour(f.kind));
        c.rect(x0, 0, x1.max(x0 + 6), TOP as i64 - 3, kind_colour(f.kind));
    }
    for e in 0..=5 {
        let y = yof(10f64.powi(e));
        for x in LEFT as i64..=x_end {
            if c.px[y as usize * W + x as usize] == 0 {
                c.set(x, y, 2);
            }
        }
        let label = match e {
            0 => "1ms".to_owned(),
            1 => "10ms".to_owned(),
            2 => "100ms".to_owned(),
            3 => "1s".to_owned(),
            4 => "10s".to_owned(),
            _ => "100s".to_owned(),
        };
        c.text(2, (y - 5).max(0), &label, 1);
    }
    // A label every 10 s, fewer on long runs so that they do not run into each other.
    let every = if seconds <= 150.0 { 1 } else if seconds <= 450.0 { 3 } else { 6 };
    let mut t = 0.0;
    let mut n = 0;
    while t <= seconds {
        let x = xof(t);
        for y in TOP as i64..=y_end {
            if c.px[y as usize * W + x as usize] == 0 {
                c.set(x, y, 2);
            }
        }
        if n % every == 0 {
            c.text(x - 4, y_end + 6, &format!("{}", t as u64), 1);
        }
        t += 10.0;
        n += 1;
    }
    c.rect(LEFT as i64, TOP as i64, LEFT as i64, y_end, 1);
    c.rect(LEFT as i64, y_end, x_end, y_end, 1);
    for p in points {
        match *p {
            Point::Verified { at, ms } => c.rect(xof(at) - 1, yof(ms) - 1, xof(at) + 1, yof(ms) + 1, 3),
            Point::Failed { at } => c.cross(xof(at), TOP as i64 + 4, 4),
            Point::Corrupt { at } => c.cross(xof(at), TOP as i64 + 12, 5),
            Point::Hung { at } => c.cross(xof(at), TOP as i64 + 20, 1),
        }
    }
    png(&c.px)
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// An 8-bit indexed PNG of `px` (W × H palette indices); the image data in stored (uncompressed)
/// deflate blocks inside a zlib stream.
fn png(px: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity((W + 1) * H);
    for row in px.chunks(W) {
        raw.push(0); // filter: none
        raw.extend(row);
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        z.extend((b.len() as u16).to_le_bytes());
        z.extend((!(b.len() as u16)).to_le_bytes());
        z.extend(*b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + x as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend(((b << 16) | a).to_be_bytes());
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    let mut ihdr = Vec::new();
    ihdr.extend((W as u32).to_be_bytes());
    ihdr.extend((H as u32).to_be_bytes());
    ihdr.extend([8, 3, 0, 0, 0]); // 8 bits, indexed, deflate, filter 0, no interlace
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"PLTE", &PALETTE.concat());
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksums agree with their definitions' published check values.
    #[test]
    fn checksums() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        let png = draw(&[Point::Verified { at: 1.0, ms: 20.0 }, Point::Failed { at: 2.0 }], &[], 10.0);
        assert_eq!(&png[1..4], b"PNG");
        assert!(png.len() > (W + 1) * H);
    }
}
