//! A card's datasheet, in Markdown and HTML: everything a person needs to write a driver for
//! the card, and nothing of how the model is built. Both come from one outline, so they say
//! the same.

use crate::card::{Card, BLOCK, PAGE};

/// A part of the datasheet.
enum Block {
    Heading(String),
    Para(String),
    Table(Vec<&'static str>, Vec<Vec<String>>),
    Steps(Vec<String>),
}

fn hex(v: u64) -> String {
    format!("{v:#x}")
}

fn outline(card: &Card) -> Vec<Block> {
    use Block::*;
    let r = &card.registers;
    let (c, s, e, o, k, d) = (card.control, card.status, card.errors, card.opcodes, card.codes, &card.descriptor);
    let access = |name: &str| match name {
        "ID" | "STATUS" | "ERROR" | "CAPACITY" | "COMPLETE_COUNT" => "read-only",
        _ => "read/write",
    };
    let meaning = |name: &str| {
        match name {
        "ID" => format!("Vendor id ({}) in bits 31:16, device id ({}) in bits 15:0.", hex(card.vendor.into()), hex(card.device.into())),
        "CONTROL" => "Enable, reset and interrupt enable (bits below).".to_string(),
        "STATUS" => "Ready and error (bits below).".to_string(),
        "ERROR" => "Why the card stopped (codes below); 0 while it has not.".to_string(),
        "CAPACITY" => format!("Size of the card in {BLOCK}-byte blocks."),
        "QUEUE_BASE" => "Bus address of the descriptor ring; read when the card is enabled.".to_string(),
        "QUEUE_ENTRIES" => "Descriptors in the ring: a power of two, 1 to 4096; read when the card is enabled.".to_string(),
        "SUBMIT_TAIL" => "Doorbell: the number of descriptors posted since the reset, wrapping at the register's width. Writing it starts the card on every descriptor up to it.".to_string(),
        "COMPLETE_COUNT" => "The number of descriptors completed since the reset, wrapping at the register's width.".to_string(),
        _ => "The driver writes here the COMPLETE_COUNT it has seen; the interrupt is raised again while completions are unacknowledged.".to_string(),
    }
    };
    let regs = r
        .all()
        .iter()
        .map(|(name, reg)| {
            vec![name.to_string(), hex(reg.offset.into()), format!("{} bits", reg.width * 8), access(name).into(), meaning(name)]
        })
        .collect();
    let mut ctl = vec![
        vec![
            c.enable.to_string(),
            "ENABLE".into(),
            "1: serve the ring given in QUEUE_BASE and QUEUE_ENTRIES. 0: stop taking descriptors.".into(),
        ],
        vec![
            c.reset.to_string(),
            "RESET".into(),
            "1: reset the card (every register to 0 but ID and CAPACITY). The card clears the bit when done.".into(),
        ],
        vec![c.irq_enable.to_string(), "IRQ_ENABLE".into(), "1: raise the interrupt on completions and errors.".into()],
    ];
    ctl.sort_by_key(|row| row[0].parse::<u32>().unwrap_or(0));
    let mut st = vec![
        vec![s.ready.to_string(), "READY".into(), "Enabled on a valid ring, and not stopped.".into()],
        vec![s.error.to_string(), "ERROR".into(), "Stopped on an error; ERROR says which. Only a reset clears it.".into()],
    ];
    st.sort_by_key(|row| row[0].parse::<u32>().unwrap_or(0));
    let errors = vec![
        vec![
            hex(e.bad_queue.into()),
            "BAD_QUEUE".into(),
            "Enabled with a ring that is not a power of two of entries, not aligned to a descriptor, or not inside DMA memory."
                .into(),
        ],
        vec![
            hex(e.bad_tail.into()),
            "BAD_TAIL".into(),
            "SUBMIT_TAIL ran more than QUEUE_ENTRIES ahead of the descriptors completed.".into(),
        ],
        vec![hex(e.reserved_bits.into()), "RESERVED".into(), "A reserved CONTROL bit was set.".into()],
    ];
    let fields = d
        .all()
        .iter()
        .map(|(name, f)| {
            let what = match *name {
                "OPCODE" => "The command (below).",
                "STATUS" => "Written by the card when it completes the descriptor (codes below).",
                "TAG" => "The driver's own; the card never reads it.",
                "LBA" => "First block.",
                "BLOCKS" => "Number of blocks.",
                _ => "Bus address of the data (read and write).",
            };
            vec![name.to_string(), f.offset.to_string(), format!("{} bytes", f.width), what.to_string()]
        })
        .collect();
    let ops = vec![
        vec![hex(o.read.into()), "READ".into(), "Blocks LBA.. to the buffer at ADDRESS.".into()],
        vec![hex(o.write.into()), "WRITE".into(), "The buffer at ADDRESS to blocks LBA...".into()],
        vec![
            hex(o.flush.into()),
            "FLUSH".into(),
            "Every write completed before it is durable. LBA, BLOCKS and ADDRESS are ignored.".into(),
        ],
        vec![hex(o.discard.into()), "DISCARD".into(), "The blocks may be forgotten; they read back as zeroes.".into()],
        vec![hex(o.write_zeroes.into()), "WRITE_ZEROES".into(), "The blocks read back as zeroes. ADDRESS is ignored.".into()],
    ];
    let codes = vec![
        vec![hex(k.ok.into()), "OK".into(), "Done.".into()],
        vec![hex(k.bad_opcode.into()), "BAD_OPCODE".into(), "Unknown command.".into()],
        vec![hex(k.out_of_range.into()), "OUT_OF_RANGE".into(), "Blocks past CAPACITY.".into()],
        vec![hex(k.bad_address.into()), "BAD_ADDRESS".into(), "The buffer is not inside DMA memory.".into()],
        vec![hex(k.bad_length.into()), "BAD_LENGTH".into(), format!("BLOCKS is 0 or more than {}.", card.max_blocks)],
        vec![hex(k.media_error.into()), "MEDIA_ERROR".into(), "The card's storage failed.".into()],
    ];
    vec![
        Heading(format!("{} storage controller (card {})", card.name, card.seed)),
        Para(format!(
            "The {} is a block storage controller of {BLOCK}-byte blocks. It has one page ({PAGE} bytes) of registers, takes commands from a ring of descriptors in DMA memory, moves data by DMA and raises one interrupt. All registers and descriptor fields are little-endian. Registers are accessed with aligned loads and stores of their full width only.",
            card.name
        )),
        Heading("Registers".into()),
        Table(vec!["Register", "Offset", "Width", "Access", "Meaning"], regs),
        Para("Writes to read-only registers are ignored.".into()),
        Heading("CONTROL".into()),
        Table(vec!["Bit", "Name", "Meaning"], ctl),
        Para("All other bits are reserved and must be written as 0; setting one stops the card with RESERVED.".into()),
        Heading("STATUS".into()),
        Table(vec!["Bit", "Name", "Meaning"], st),
        Heading("ERROR codes".into()),
        Table(vec!["Value", "Name", "Cause"], errors),
        Para("A stopped card takes no more descriptors until it is reset, and raises its interrupt when it stops (if enabled).".into()),
        Heading("DMA".into()),
        Para(format!(
            "The card reaches DMA memory only. Its bus addresses start at {}: the byte at offset n of DMA memory has bus address {} + n. QUEUE_BASE and every descriptor's ADDRESS are bus addresses.",
            hex(card.dma_base),
            hex(card.dma_base)
        )),
        Heading("Descriptors".into()),
        Para(format!(
            "A descriptor is {} bytes; the ring is QUEUE_ENTRIES descriptors back to back, and descriptor n (counting from the reset) sits at entry n mod QUEUE_ENTRIES. Bytes not listed are ignored.",
            d.size
        )),
        Table(vec!["Field", "Byte offset", "Width", "Meaning"], fields),
        Heading("Commands".into()),
        Table(vec!["Opcode", "Name", "Does"], ops),
        Para(format!("A command moves at most {} blocks.", card.max_blocks)),
        Heading("Completion status".into()),
        Table(vec!["Code", "Name", "Meaning"], codes),
        Para("The card never writes a STATUS of all ones: a driver may put that in a descriptor it posts, to tell one the card has not completed.".into()),
        Heading("Interrupts".into()),
        Para(format!(
            "With IRQ_ENABLE set the card raises its interrupt after every {} completion(s), when it has taken every posted descriptor and some completions are not yet signalled, when it stops on an error, and again while COMPLETE_COUNT differs from IRQ_ACK after a register write. The interrupt carries no data: read COMPLETE_COUNT and the descriptors' STATUS fields.",
            card.irq_coalesce
        )),
        Heading("Programming".into()),
        Steps(vec![
            "Write CONTROL with only RESET set; wait until RESET reads 0.".into(),
            "Check ID, and read CAPACITY (after the reset: until then the registers hold whatever the last driver left).".into(),
            "Put the descriptor ring in DMA memory; write its bus address to QUEUE_BASE and its length to QUEUE_ENTRIES.".into(),
            "Write CONTROL with ENABLE (and IRQ_ENABLE to use the interrupt); wait for READY (or ERROR).".into(),
            "For each command, fill the next descriptor, then write the total number posted to SUBMIT_TAIL. Never post more than QUEUE_ENTRIES beyond COMPLETE_COUNT.".into(),
            "On the interrupt (or by reading COMPLETE_COUNT), read each completed descriptor's STATUS, then write COMPLETE_COUNT to IRQ_ACK.".into(),
            "If STATUS shows ERROR, read ERROR and reset the card.".into(),
        ]),
    ]
}

/// The datasheet in Markdown.
pub fn markdown(card: &Card) -> String {
    let mut out = String::new();
    let mut first = true;
    for b in outline(card) {
        match b {
            Block::Heading(h) => {
                out += &format!("{} {h}\n\n", if first { "#" } else { "##" });
                first = false;
            }
            Block::Para(p) => out += &format!("{p}\n\n"),
            Block::Table(head, rows) => {
                out += &format!("| {} |\n", head.join(" | "));
                out += &format!("|{}\n", "---|".repeat(head.len()));
                for row in rows {
                    out += &format!("| {} |\n", row.join(" | "));
                }
                out += "\n";
            }
            Block::Steps(steps) => {
                for (i, s) in steps.iter().enumerate() {
                    out += &format!("{}. {s}\n", i + 1);
                }
                out += "\n";
            }
        }
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The datasheet in HTML (one page, no scripts).
pub fn html(card: &Card) -> String {
    let mut body = String::new();
    let mut first = true;
    for b in outline(card) {
        match b {
            Block::Heading(h) => {
                let tag = if first { "h1" } else { "h2" };
                body += &format!("<{tag}>{}</{tag}>\n", esc(&h));
                first = false;
            }
            Block::Para(p) => body += &format!("<p>{}</p>\n", esc(&p)),
            Block::Table(head, rows) => {
                body += "<table>\n<tr>";
                for h in head {
                    body += &format!("<th>{}</th>", esc(h));
                }
                body += "</tr>\n";
                for row in rows {
                    body += "<tr>";
                    for cell in row {
                        body += &format!("<td>{}</td>", esc(&cell));
                    }
                    body += "</tr>\n";
                }
                body += "</table>\n";
            }
            Block::Steps(steps) => {
                body += "<ol>\n";
                for s in steps {
                    body += &format!("<li>{}</li>\n", esc(&s));
                }
                body += "</ol>\n";
            }
        }
    }
    format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{} datasheet</title>\n<style>body{{font-family:sans-serif;max-width:60em;margin:auto}}table{{border-collapse:collapse}}td,th{{border:1px solid #999;padding:2px 6px;text-align:left}}</style></head><body>\n{body}</body></html>\n",
        esc(&card.name)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_datasheet_names_every_register_field_and_code_of_the_card() {
        let card = Card::generate(42);
        let md = markdown(&card);
        let html = html(&card);
        for (name, reg) in card.registers.all() {
            assert!(md.contains(&format!("| {name} | {:#x} |", reg.offset)), "{name} in markdown");
            assert!(html.contains(&format!("<td>{name}</td><td>{:#x}</td>", reg.offset)), "{name} in html");
        }
        for (name, f) in card.descriptor.all() {
            assert!(md.contains(&format!("| {name} | {} | {} bytes |", f.offset, f.width)));
        }
        assert!(md.contains(&format!("| {:#x} | WRITE |", card.opcodes.write)));
        assert!(md.contains(&format!("{:#x}", card.dma_base)));
        assert_eq!(markdown(&Card::generate(42)), md, "the same seed, the same datasheet");
        assert_ne!(markdown(&Card::generate(43)), md);
    }
}
