//! Token spans over page lists: which pool slots hold a chunk's tokens when a chunk need not
//! start or end on one of this side's pages (the two sides' page sizes differ, the decode side's
//! cached prefix ends inside a prefill page, the request ends inside a page).

use super::plan::Segment;
use crate::error::{Error, Result};

/// Tokens `[first_token, first_token + tokens)` of a page list: list token `t` lives in slot
/// `t mod page_size` of pool page `pages[t / page_size]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageSpan<'a> {
    pub pages: &'a [u32],
    /// Slots of `pages[0]` before the span's first token (below the page size).
    pub first_token: u32,
    pub tokens: u64,
}

impl<'a> PageSpan<'a> {
    /// Every slot of every page.
    pub fn whole(pages: &'a [u32], page_size: u32) -> PageSpan<'a> {
        PageSpan { pages, first_token: 0, tokens: pages.len() as u64 * page_size as u64 }
    }

    /// Checks that the pages hold exactly the span: its first token lies in the first page and its
    /// last token in the last page (`KVSTAGE_E_INVALID_ARG` naming `pages_arg` or `offset_arg`).
    pub fn check(&self, page_size: u32, pages_arg: &str, offset_arg: &str) -> Result<()> {
        let ps = page_size.max(1) as u64;
        if self.first_token as u64 >= ps {
            return Err(Error::invalid_arg(
                offset_arg,
                format!("{} is not inside the first page (page_size {page_size}: 0..{ps})", self.first_token),
            ));
        }
        let end = self.first_token as u64 + self.tokens;
        let needed = end.div_ceil(ps);
        if self.pages.len() as u64 != needed {
            return Err(Error::invalid_arg(
                pages_arg,
                format!(
                    "holds {} pages, the tokens {}..{end} of its pages (page_size {page_size}) need {needed}",
                    self.pages.len(),
                    self.first_token
                ),
            ));
        }
        Ok(())
    }

    /// Runs of consecutive pool slots in span order, `staging_token` counting from the span's
    /// first token; pages that follow each other in the pool are merged where `merge_pages` (the
    /// pool's pages are evenly spaced). Assumes [`Self::check`].
    pub fn segments(&self, page_size: u32, merge_pages: bool) -> Vec<Segment> {
        let ps = page_size as u64;
        let (start, end) = (self.first_token as u64, self.first_token as u64 + self.tokens);
        let mut out: Vec<Segment> = Vec::new();
        for (i, &page) in self.pages.iter().enumerate() {
            let lo = start.max(i as u64 * ps);
            let hi = end.min((i as u64 + 1) * ps);
            if lo >= hi {
                continue;
            }
            let pool_token = page as u64 * ps + (lo - i as u64 * ps);
            match out.last_mut() {
                Some(seg) if merge_pages && seg.pool_token + seg.tokens == pool_token => seg.tokens += hi - lo,
                _ => out.push(Segment { pool_token, staging_token: lo - start, tokens: hi - lo }),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    fn seg(pool_token: u64, staging_token: u64, tokens: u64) -> Segment {
        Segment { pool_token, staging_token, tokens }
    }

    #[test]
    fn spans_start_and_end_inside_pages() {
        // Pages of 4: tokens 3..9 of pages [7, 8, 2] are slot 3 of page 7, page 8, slot 0 of page 2.
        let span = PageSpan { pages: &[7, 8, 2], first_token: 3, tokens: 6 };
        span.check(4, "pages", "first").unwrap();
        assert_eq!(span.segments(4, true), vec![seg(31, 0, 5), seg(8, 5, 1)]);
        let whole = PageSpan::whole(&[5, 6, 1], 4);
        assert_eq!(whole.segments(4, true), vec![seg(20, 0, 8), seg(4, 8, 4)]);
        // A page list that repeats a page does not merge backwards.
        assert_eq!(PageSpan::whole(&[3, 3], 2).segments(2, true), vec![seg(6, 0, 2), seg(6, 2, 2)]);
    }

    #[test]
    fn check_names_the_argument() {
        let e = PageSpan { pages: &[1, 2], first_token: 4, tokens: 1 }.check(4, "pages", "first").unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert_eq!(e.message(), "invalid argument `first`: 4 is not inside the first page (page_size 4: 0..4)");
        let e = PageSpan { pages: &[1, 2, 3], first_token: 1, tokens: 4 }.check(4, "pages", "first").unwrap_err();
        assert_eq!(e.message(), "invalid argument `pages`: holds 3 pages, the tokens 1..5 of its pages (page_size 4) need 2");
        let e = PageSpan { pages: &[1], first_token: 1, tokens: 4 }.check(4, "pages", "first").unwrap_err();
        assert!(e.message().contains("holds 1 pages, the tokens 1..5"), "{}", e.message());
    }
}
