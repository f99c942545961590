//! Engine KV events → kvroute event batches, for one engine.
//!
//! vLLM's block hashes are salted per process and cannot be recomputed outside the
//! engine, so kvroute names each stored block itself: the chain hash of its token ids
//! (the same function the filter applies to prompts), continued from the kvroute hash of
//! the engine's parent block. A map engine hash → kvroute hash resolves parents and
//! removals; it also is the engine's current cache as kvroute knows it, served as the
//! pod's dump for sidecar resyncs.
//!
//! Sequence numbers: the engine numbers its batches; this side numbers what it emits,
//! per epoch. An engine restart (its stream reconnects, or its sequence goes back) is a
//! new kvroute epoch — the
//! sidecars drop the pod's blocks at once. A gap (lost ZMQ batches, so lost removals) is
//! a new epoch too — stale facts are worse than missing ones — unless the bridge could
//! fill it from the engine's replay socket first. Translations survive a gap
//! (engine hashes name content, so they stay true) so later blocks still chain; only
//! what is resident is reset.
//!
//! A request's `cache_salt` (vLLM puts it in the first block's `extra_keys`) names its
//! blocks in the salt's namespace, as the filter and sidecar name that request. Blocks
//! kvroute cannot name from tokens — multimodal inputs, prompt embeddings (other
//! `extra_keys`), a block size other than the filter's, a parent never seen (the bridge
//! started after the engine), a second KV cache group — are skipped and counted by
//! reason; routing then treats them as misses, never as wrong hits.

use std::collections::{BTreeMap, HashMap};

use kvroute_shared::protocol::{Event, EventBatch, Tier, EVENT_VERSION};
use kvroute_shared::{ChainHasher, Mode, Namespace};

use crate::vllm::{EngineBatch, EngineEvent, Extra};

/// What the translator knows of one engine block.
#[derive(Clone, Copy, Debug)]
struct Known {
    hash: u64,
    /// Tiers holding it (bit per [`Tier::ALL`] index); 0 = translation kept, not resident.
    tiers: u8,
}

fn bit(t: Tier) -> u8 {
    1 << Tier::ALL.iter().position(|&x| x == t).unwrap_or(0)
}

/// Counters for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub batches_in: u64,
    pub batches_out: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub restarts: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Blocks (or events, for unknown kinds) not translated, by reason.
    pub skipped: BTreeMap<&'static str, u64>,
}

pub struct Translator {
    pod: String,
    model: String,
    block_size: u32,
    epoch_base: String,
    epochs: u64,
    next_seq: u64,
    last_engine_seq: Option<u64>,
    known: HashMap<u64, Known>,
    /// Advertised in every batch, so sidecars that never saw a registration can resync.
    dump_url: Option<String>,
    pub stats: Stats,
}

impl Translator {
    /// `epoch_base` must differ between runs of the bridge (a start time, a pod uid).
    pub fn new(pod: &str, model: &str, block_size: u32, epoch_base: &str) -> Self {
        Translator {
            pod: pod.to_string(),
            model: model.to_string(),
            block_size: block_size.max(1),
            epoch_base: epoch_base.to_string(),
            epochs: 0,
            next_seq: 0,
            last_engine_seq: None,
            known: HashMap::new(),
            dump_url: None,
            stats: Stats::default(),
        }
    }

    pub fn with_dump_url(mut self, url: Option<String>) -> Self {
        self.dump_url = url;
        self
    }

    pub fn epoch(&self) -> String {
        format!("{}-{}", self.epoch_base, self.epochs)
    }

    fn new_epoch(&mut self) {
        self.epochs += 1;
        self.next_seq = 0;
    }

    fn skip(&mut self, why: &'static str, n: usize) {
        *self.stats.skipped.entry(why).or_default() += n as u64;
    }

    /// One engine batch in; the kvroute batch to publish, if it changes anything.
    pub fn on_batch(&mut self, engine_seq: u64, b: &EngineBatch) -> Option<EventBatch> {
        self.stats.batches_in += 1;
        let epoch = self.epochs;
        match self.last_engine_seq {
            Some(last) if engine_seq == last => {
                self.stats.duplicates += 1;
                return None;
            }
            Some(last) if engine_seq < last => {
                // The engine restarted: nothing it held before is there.
                self.stats.restarts += 1;
                self.known.clear();
                self.new_epoch();
            }
            Some(last) if engine_seq > last.saturating_add(1) => {
                self.stats.gaps += 1;
                for k in self.known.values_mut() {
                    k.tiers = 0;
                }
                self.new_epoch();
            }
            _ => {}
        }
        self.last_engine_seq = Some(engine_seq);
        let mut events = Vec::new();
        for e in &b.events {
            match e {
                EngineEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    lora,
                    tier,
                    extra,
                    group,
                } => {
                    if let Some(ev) = self.stored(
                        hashes,
                        *parent,
                        tokens,
                        *block_size,
                        lora,
                        *tier,
                        extra,
                        *group,
                    ) {
                        events.push(ev);
                    }
                }
                EngineEvent::Removed {
                    hashes,
                    tier,
                    group,
                } => {
                    if group.unwrap_or(0) != 0 {
                        self.skip("other_kv_group", hashes.len());
                        continue;
                    }
                    let mut blocks = Vec::with_capacity(hashes.len());
                    for h in hashes {
                        if let Some(k) = self.known.get_mut(h) {
                            if k.tiers & bit(*tier) != 0 {
                                blocks.push(k.hash);
                            }
                            k.tiers &= !bit(*tier);
                            if k.tiers == 0 {
                                self.known.remove(h);
                            }
                        }
                    }
                    if !blocks.is_empty() {
                        self.stats.blocks_removed += blocks.len() as u64;
                        events.push(Event::Removed {
                            tier: *tier,
                            blocks,
                        });
                    }
                }
                EngineEvent::Cleared => {
                    self.known.clear();
                    events.push(Event::Cleared);
                }
                EngineEvent::Unknown(_) => self.skip("unknown_event", 1),
            }
        }
        // A new epoch goes out even when empty: it tells the sidecars to drop the pod's
        // blocks now, not at the engine's next cache change.
        if events.is_empty() && epoch == self.epochs {
            return None;
        }
        Some(self.emit(b.ts, events))
    }

    /// The engine's own load (from its metrics endpoint), as a batch of this epoch.
    pub fn load(&mut self, running: u32, waiting: u32, kv_usage: f64) -> EventBatch {
        self.emit(
            None,
            vec![Event::Load {
                running,
                waiting,
                kv_usage,
                capacity_blocks: None,
            }],
        )
    }

    fn emit(&mut self, ts: Option<f64>, events: Vec<Event>) -> EventBatch {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stats.batches_out += 1;
        EventBatch {
            v: EVENT_VERSION,
            pod: self.pod.clone(),
            model: self.model.clone(),
            epoch: self.epoch(),
            seq,
            ts,
            dump_url: self.dump_url.clone(),
            events,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn stored(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        block_size: u32,
        lora: &Option<String>,
        tier: Tier,
        extra: &[Extra],
        group: Option<i64>,
    ) -> Option<Event> {
        if group.unwrap_or(0) != 0 {
            self.skip("other_kv_group", hashes.len());
            return None;
        }
        if block_size != self.block_size {
            self.skip("block_size_mismatch", hashes.len());
            return None;
        }
        if hashes.len().checked_mul(block_size as usize) != Some(tokens.len()) {
            self.skip("partial_blocks", hashes.len());
            return None;
        }
        // vLLM puts a request's cache_salt in its first block's extra keys (and, through
        // the chain, it covers every later block): kvroute names such blocks in the salt's
        // namespace, as the filter and sidecar name that request's prompt.
        let (salt, salted) = match (parent, extra.first()) {
            (None, Some(Extra::Strings(k))) if k.len() == 1 => (k[0].as_str(), 1),
            _ => ("", 0),
        };
        let ns = Namespace {
            mode: Mode::Tokens,
            block_size,
            model: &self.model,
            adapter: lora.as_deref().unwrap_or(""),
            cache_salt: salt,
        };
        let (mut h, kv_parent) = match parent {
            None => (ChainHasher::new(&ns), None),
            Some(p) => match self.known.get(&p) {
                Some(k) => (ChainHasher::resume(&ns, k.hash), Some(k.hash)),
                None => {
                    self.skip("unknown_parent", hashes.len());
                    return None;
                }
            },
        };
        // Blocks up to the first one whose engine hash covers more than its tokens; the
        // rest of the event descends from it, so none of it can be named either.
        let plain = extra
            .iter()
            .skip(salted)
            .position(|x| *x != Extra::None)
            .map_or(hashes.len(), |p| p + salted)
            .min(hashes.len());
        if plain < hashes.len() {
            self.skip("extra_keys", hashes.len() - plain);
        }
        h.push_tokens(tokens.get(..plain * block_size as usize)?);
        let chain = h.finish();
        for (eh, kh) in hashes.iter().zip(&chain) {
            let k = self.known.entry(*eh).or_insert(Known {
                hash: *kh,
                tiers: 0,
            });
            k.hash = *kh;
            k.tiers |= bit(tier);
        }
        if chain.is_empty() {
            return None;
        }
        self.stats.blocks_stored += chain.len() as u64;
        Some(Event::Stored {
            tier,
            parent: kv_parent,
            blocks: chain,
            tokens: None,
        })
    }

    /// The engine's cache as kvroute knows it, as of the last batch emitted.
    pub fn dump(&self) -> EventBatch {
        let events = Tier::ALL
            .iter()
            .filter_map(|&t| {
                let mut blocks: Vec<u64> = self
                    .known
                    .values()
                    .filter(|k| k.tiers & bit(t) != 0)
                    .map(|k| k.hash)
                    .collect();
                blocks.sort_unstable();
                (!blocks.is_empty()).then_some(Event::Stored {
                    tier: t,
                    parent: None,
                    blocks,
                    tokens: None,
                })
            })
            .collect();
        EventBatch {
            v: EVENT_VERSION,
            pod: self.pod.clone(),
            model: self.model.clone(),
            epoch: self.epoch(),
            seq: self.next_seq.saturating_sub(1),
            ts: None,
            dump_url: None,
            events,
        }
    }

    /// The engine's stream was cut and re-established. Next to the engine that means
    /// it restarted (its new sequence may even look like a repeat, and its first
    /// batches may have gone before the reconnection): forget it all and announce a new
    /// epoch now. `None` for the first connection.
    pub fn reconnected(&mut self) -> Option<EventBatch> {
        if self.last_engine_seq.is_none() && self.known.is_empty() {
            return None;
        }
        self.stats.restarts += 1;
        self.known.clear();
        self.last_engine_seq = None;
        self.new_epoch();
        Some(self.emit(None, vec![]))
    }

    /// The engine's sequence number of the last batch taken in.
    pub fn last_engine_seq(&self) -> Option<u64> {
        self.last_engine_seq
    }

    /// Engine blocks with a translation (resident or kept across a gap).
    pub fn known_blocks(&self) -> usize {
        self.known.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 4;

    fn ns(adapter: &str) -> Namespace<'_> {
        Namespace {
            mode: Mode::Tokens,
            block_size: BS,
            model: "m",
            adapter,
            cache_salt: "",
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> EngineEvent {
        EngineEvent::Stored {
            hashes: hashes.to_vec(),
            parent,
            tokens: tokens.to_vec(),
            block_size: BS,
            lora: None,
            tier: Tier::Gpu,
            extra: vec![Extra::None; hashes.len()],
            group: None,
        }
    }

    fn batch(events: Vec<EngineEvent>) -> EngineBatch {
        EngineBatch {
            ts: Some(1.0),
            events,
            dp_rank: None,
        }
    }

    fn blocks_of(b: &EventBatch) -> Vec<u64> {
        b.events
            .iter()
            .flat_map(|e| match e {
                Event::Stored { blocks, .. } => blocks.clone(),
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn stored_blocks_get_the_filters_chain_hashes_across_events() {
        let toks: Vec<u32> = (1..=16).collect();
        let want = ns("").chain_tokens(&toks);
        let mut t = Translator::new("10.0.0.1:8000", "m", BS, "e");
        // The engine stores the prompt in two events, the second naming its parent.
        let a = t
            .on_batch(0, &batch(vec![stored(&[901, 902], None, &toks[..8])]))
            .expect("a batch");
        let b = t
            .on_batch(1, &batch(vec![stored(&[903, 904], Some(902), &toks[8..])]))
            .expect("a batch");
        assert_eq!(blocks_of(&a), want[..2]);
        assert_eq!(blocks_of(&b), want[2..]);
        assert_eq!((a.seq, b.seq, a.epoch.as_str()), (0, 1, "e-0"));
        assert!(matches!(&b.events[0], Event::Stored { parent: Some(p), .. } if *p == want[1]));
        assert_eq!(a.validate(), Ok(()));
        // Removal by engine hash names the kvroute block; the dump is what is left.
        let r = t
            .on_batch(
                2,
                &batch(vec![EngineEvent::Removed {
                    hashes: vec![904, 777],
                    tier: Tier::Gpu,
                    group: None,
                }]),
            )
            .expect("a batch");
        assert_eq!(
            r.events,
            vec![Event::Removed {
                tier: Tier::Gpu,
                blocks: vec![want[3]]
            }]
        );
        let mut left = want[..3].to_vec();
        left.sort_unstable();
        assert_eq!(blocks_of(&t.dump()), left);
        assert_eq!(t.dump().seq, 2);
    }

    #[test]
    fn lora_blocks_live_in_the_adapters_namespace() {
        let toks: Vec<u32> = (1..=4).collect();
        let mut t = Translator::new("p:1", "m", BS, "e");
        let ev = EngineEvent::Stored {
            hashes: vec![1],
            parent: None,
            tokens: toks.clone(),
            block_size: BS,
            lora: Some("sql".into()),
            tier: Tier::Gpu,
            extra: vec![Extra::None],
            group: None,
        };
        let b = t.on_batch(0, &batch(vec![ev])).expect("a batch");
        assert_eq!(blocks_of(&b), ns("sql").chain_tokens(&toks));
    }

    /// A salted request's blocks are named in the salt's namespace — what the filter and
    /// the sidecar compute for that request — including blocks stored later under them.
    #[test]
    fn cache_salted_blocks_live_in_the_salts_namespace() {
        let toks: Vec<u32> = (1..=12).collect();
        let mut t = Translator::new("p:1", "m", BS, "e");
        let mut first = stored(&[1, 2], None, &toks[..8]);
        if let EngineEvent::Stored { extra, .. } = &mut first {
            extra[0] = Extra::Strings(vec!["tenant-a".into()]);
        }
        let b = t.on_batch(0, &batch(vec![first])).expect("a batch");
        let salted = Namespace {
            mode: Mode::Tokens,
            block_size: BS,
            model: "m",
            adapter: "",
            cache_salt: "tenant-a",
        };
        assert_eq!(blocks_of(&b), salted.chain_tokens(&toks[..8]));
        let b = t
            .on_batch(1, &batch(vec![stored(&[3], Some(2), &toks[8..])]))
            .expect("a batch");
        assert_eq!(blocks_of(&b), salted.chain_tokens(&toks)[2..].to_vec());
        // A salt-looking key on a block that does not start a request is not a salt.
        let mut later = stored(&[4], Some(3), &toks[..4]);
        if let EngineEvent::Stored { extra, .. } = &mut later {
            extra[0] = Extra::Strings(vec!["x".into()]);
        }
        assert!(t.on_batch(2, &batch(vec![later])).is_none());
        assert_eq!(t.stats.skipped.get("extra_keys"), Some(&1));
    }

    #[test]
    fn what_cannot_be_named_from_tokens_is_skipped_and_counted() {
        let toks: Vec<u32> = (1..=12).collect();
        let mut t = Translator::new("p:1", "m", BS, "e");
        let mut salted = stored(&[1, 2, 3], None, &toks);
        if let EngineEvent::Stored { extra, .. } = &mut salted {
            extra[1] = Extra::Opaque;
        }
        let mut other_bs = stored(&[9], None, &toks[..8]);
        if let EngineEvent::Stored { block_size, .. } = &mut other_bs {
            *block_size = 8;
        }
        let b = t
            .on_batch(
                0,
                &batch(vec![
                    salted,
                    stored(&[5], Some(4242), &toks[..4]),
                    other_bs,
                    stored(&[6, 7], None, &toks[..4]),
                    EngineEvent::Unknown("BlockPinned".into()),
                ]),
            )
            .expect("the one plain block");
        assert_eq!(blocks_of(&b), ns("").chain_tokens(&toks[..4]));
        let s = &t.stats.skipped;
        assert_eq!(s.get("extra_keys"), Some(&2));
        assert_eq!(s.get("unknown_parent"), Some(&1));
        assert_eq!(s.get("block_size_mismatch"), Some(&1));
        assert_eq!(s.get("partial_blocks"), Some(&2));
        assert_eq!(s.get("unknown_event"), Some(&1));
    }

    #[test]
    fn restarts_and_gaps_start_a_new_epoch_duplicates_are_dropped() {
        let toks: Vec<u32> = (1..=8).collect();
        let mut t = Translator::new("p:1", "m", BS, "e");
        let one = batch(vec![stored(&[1], None, &toks[..4])]);
        assert!(t.on_batch(5, &one).is_some());
        assert!(t.on_batch(5, &one).is_none());
        assert_eq!(t.stats.duplicates, 1);
        // A reconnection is a restart: announced at once, and batch 0 is then new.
        let mut r = Translator::new("p:1", "m", BS, "r");
        assert!(r.reconnected().is_none(), "the first connection");
        assert!(r.on_batch(0, &one).is_some());
        let now = r.reconnected().expect("a new epoch");
        assert_eq!(
            (now.epoch.as_str(), now.seq, now.events.len()),
            ("r-1", 0, 0)
        );
        let again = r.on_batch(0, &one).expect("batch 0 of the new engine");
        assert_eq!(
            (again.epoch.as_str(), again.seq, r.stats.restarts),
            ("r-1", 1, 1)
        );
        assert_eq!(r.stats.duplicates, 0);
        // A gap: new epoch, nothing resident, but the parent still translates.
        let child = batch(vec![stored(&[2], Some(1), &toks[4..])]);
        let b = t.on_batch(9, &child).expect("a batch");
        assert_eq!((b.epoch.as_str(), b.seq), ("e-1", 0));
        assert_eq!(blocks_of(&b), ns("").chain_tokens(&toks)[1..]);
        assert_eq!(blocks_of(&t.dump()), blocks_of(&b));
        // A restart (the engine counts from 0 again): translations go too.
        let orphan = batch(vec![stored(&[3], Some(1), &toks[4..])]);
        let r = t.on_batch(0, &orphan).expect("the new epoch is announced");
        assert_eq!((r.epoch.as_str(), r.seq, r.events.len()), ("e-2", 0, 0));
        assert_eq!((t.stats.gaps, t.stats.restarts), (1, 1));
        assert_eq!(t.known_blocks(), 0);
        // Cleared empties the cache and is passed on.
        let c = t
            .on_batch(1, &batch(vec![EngineEvent::Cleared]))
            .expect("a batch");
        assert_eq!(c.events, vec![Event::Cleared]);
    }
}
