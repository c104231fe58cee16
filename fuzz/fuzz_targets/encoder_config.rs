//! A ScopeMem `scopemem_config.json`: `ScopeMemConfig::from_json` accepts or names the field; an
//! accepted config's tensor list and parameter count are computed without overflow panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::model::scopemem::ScopeMemConfig;

fuzz_target!(|text: &str| {
    let Ok(doc) = serde_json::from_str::<serde_json::Value>(text) else { return };
    if let Ok(cfg) = ScopeMemConfig::from_json(std::path::Path::new("scopemem_config.json"), &doc) {
        let small = [cfg.hidden_size, cfg.d_model, cfg.ffn_size, cfg.conf_hidden, cfg.max_positions, cfg.num_queries]
            .iter()
            .all(|&v| v < 1 << 16)
            && cfg.num_self_layers + cfg.num_cross_layers < 64;
        if small {
            let n: usize = cfg.tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
            assert_eq!(n, cfg.num_parameters());
        }
    }
});
