//! Plain aligned tables for list commands.

pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&'static str]) -> Self {
        Table {
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.len()).collect();
        for r in &self.rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.len());
            }
        }
        let line = |cells: Vec<&str>| {
            let mut s = String::new();
            for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
                if i + 1 == cells.len() {
                    s.push_str(c);
                } else {
                    s.push_str(&format!("{c:<w$}  "));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(self.header.clone());
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r.iter().map(String::as_str).collect()));
        }
        out
    }

    pub fn print(&self) {
        println!("{}", self.render());
    }
}

#[cfg(test)]
mod test {
    #[test]
    fn aligns_columns() {
        let mut t = super::Table::new(&["NAME", "SIZE"]);
        t.row(vec!["default".into(), "1G".into()]);
        t.row(vec!["a".into(), "512M".into()]);
        assert_eq!(t.render(), "NAME     SIZE\ndefault  1G\na        512M");
    }
}
