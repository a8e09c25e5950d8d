//! Aligned plain-text tables: what the `nacre` and `nacre-host` commands print for people
//! (`--json` is the format for scripts).
//!
//! Each column is as wide as its widest cell, columns two spaces apart. Cells are left-aligned
//! unless their column is marked right-aligned (counts, sizes, offsets). The last column of a
//! line is not padded when it is left-aligned, so a long description is never cut, and no line
//! ends in blanks.

/// A table: an optional title line, then rows of cells.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    right: Vec<usize>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles; an empty `header` prints no title line.
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            ..Table::default()
        }
    }

    /// Right-align the columns numbered in `cols` (from 0), title included.
    pub fn right(mut self, cols: &[usize]) -> Self {
        self.right.extend_from_slice(cols);
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let lines = (!self.header.is_empty())
            .then_some(&self.header)
            .into_iter()
            .chain(&self.rows);
        let mut widths: Vec<usize> = Vec::new();
        for r in lines.clone() {
            if widths.len() < r.len() {
                widths.resize(r.len(), 0);
            }
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = Vec::new();
        for r in lines {
            let mut s = String::new();
            for (i, (c, &w)) in r.iter().zip(&widths).enumerate() {
                if i > 0 {
                    s.push_str("  ");
                }
                if self.right.contains(&i) {
                    s.push_str(&format!("{c:>w$}"));
                } else if i + 1 == r.len() {
                    s.push_str(c);
                } else {
                    s.push_str(&format!("{c:<w$}"));
                }
            }
            out.push(s.trim_end().to_string());
        }
        out.join("\n")
    }

    pub fn print(&self) {
        println!("{}", self.render());
    }
}

#[cfg(test)]
mod test {
    use super::Table;

    #[test]
    fn aligns_columns() {
        let mut t = Table::new(&["NAME", "SIZE"]);
        t.row(vec!["default".into(), "1G".into()]);
        t.row(vec!["a".into(), "512M".into()]);
        assert_eq!(t.render(), "NAME     SIZE\ndefault  1G\na        512M");
    }

    #[test]
    fn right_aligns_numbers_and_leaves_the_last_column_unpadded() {
        let mut t = Table::new(&["OFFSET", "NAME", "DESCRIPTION"]).right(&[0]);
        t.row(vec![
            "0".into(),
            "boot-args".into(),
            "boot arguments".into(),
        ]);
        t.row(vec!["4096".into(), "x".into(), String::new()]);
        assert_eq!(
            t.render(),
            "OFFSET  NAME       DESCRIPTION\n     0  boot-args  boot arguments\n  4096  x"
        );
    }

    #[test]
    fn without_a_header_prints_only_rows() {
        let mut t = Table::new(&[]);
        t.row(vec!["volume_list".into(), "List volumes.".into()]);
        t.row(vec!["rpc_get_methods".into(), "List methods.".into()]);
        assert_eq!(
            t.render(),
            "volume_list      List volumes.\nrpc_get_methods  List methods."
        );
        assert_eq!(Table::new(&[]).render(), "");
    }
}
