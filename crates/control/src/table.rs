//! Plain text tables, as `bulkhead status` prints replies and `bulkhead-bench` its reports.

/// A table printed with aligned columns.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with a header row.
    pub fn new(header: &[&str]) -> Self {
        Table { rows: vec![header.iter().map(|s| s.to_string()).collect()] }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders the table.
    pub fn render(&self) -> String {
        let cols = self.rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let widths: Vec<usize> =
            (0..cols).map(|c| self.rows.iter().map(|r| r.get(c).map_or(0, |s| s.chars().count())).max().unwrap_or(0)).collect();
        let mut out = String::new();
        for r in &self.rows {
            let line: Vec<String> = r.iter().enumerate().map(|(i, s)| format!("{s:<w$}", w = widths[i])).collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        out
    }
}
