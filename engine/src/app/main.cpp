// engine: train from a TOML file with plugins chosen at run time.
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <boost/program_options.hpp>

#include <ember/error.h>

#include "config/run_config.h"
#include "common/log.h"
#include "app/data_pack.h"
#include "app/plot.h"
#include "registry/plugin_registry.h"
#include "app/commands.h"
#include "common/version.h"

namespace po = boost::program_options;
using namespace ember::engine;

namespace {

const char* kUsage =
    "usage:\n"
    "  engine [--plugins a,b,...] [--set section.key=value ...] [--resume last|auto|best|PATH] run.toml\n"
    "      train (fit, then test when trainer.test_after_fit is set)\n"
    "  engine validate|test|predict [--ckpt best|last|PATH] [--plugins ...] [--set ...] run.toml\n"
    "      one validation or test pass (Lightning's trainer.validate/test) over a checkpoint's weights, or\n"
    "      predictions.csv for data.predict_split (trainer.predict); best/last: the newest run of this\n"
    "      config that saved one; no --ckpt: the model as set up\n"
    "  engine generate [--ckpt best|last|PATH] [--prompt TEXT] [--max-new-tokens N] [--temperature T] [--top-k K]\n"
    "                  [--top-p P] [--seed S] [--no-kv-cache] run.toml\n"
    "      text from a language model (gpt + text_lm): the prompt (--prompt, else standard input), then the\n"
    "      sampled tokens as they come; <run folder>/generated.txt keeps it\n"
    "  engine config [--plugins ...] [--set ...] run.toml   print the resolved configuration as TOML\n"
    "  engine plugins list                                   list the plugins found\n"
    "  engine plugins info NAME                              a plugin's kind, version, file and config keys\n"
    "  engine checkpoint consolidate DIR OUT.ckpt [--weights-only]\n"
    "      one checkpoint file from a sharded checkpoint directory (--weights-only: the model's weights alone, for\n"
    "      testing, exporting or [model] init_checkpoint; the optimizer state is neither read nor gathered)\n"
    "  engine checkpoint info CKPT                           what a checkpoint holds (step, model tensors, plugin states)\n"
    "  engine checkpoint verify CKPT                         whether a checkpoint (or each file of a sharded one) is intact:\n"
    "      every record against its CRC32C, read in chunks; exit 1 naming what is damaged\n"
    "  engine export CKPT [--format safetensors] OUT         the checkpoint's model weights for other libraries: OUT.safetensors,\n"
    "      or a folder with model.safetensors and what the model adds (bert: config.json and tokenizer for transformers);\n"
    "      --format peft: a LoRA run's adapters alone as a PEFT folder (adapter_model.safetensors, adapter_config.json)\n"
    "  engine plot RUN_DIR... --output FILE.png              draw the runs' loss, accuracy and lr curves\n"
    "  engine data pack SOURCE OUT_DIR [--max-count N] [--max-mb M] [--seed S] [--no-shuffle] [--prefix NAME]\n"
    "      an image folder (<root>/<class>/*.jpg|png) or a .csv/.jsonl list of path and label as WebDataset tar\n"
    "      shards (the webdataset data plugin reads them) and OUT_DIR/NAME.json, their shard list\n";

std::vector<std::string> split_commas(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const auto& item : items) {
    size_t start = 0;
    while (start <= item.size()) {
      auto end = item.find(',', start);
      auto part = item.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (!part.empty()) out.push_back(part);
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  return out;
}

// The attempt number of a restarted job and the variable that says it: Ember's own launcher
// (trainer.max_restarts) sets EMBER_RESTART_COUNT, torchrun's elastic agent
// TORCHELASTIC_RESTART_COUNT, SLURM's requeue SLURM_RESTART_COUNT; {0, ""} otherwise.
std::pair<int64_t, std::string> restart_attempt() {
  for (const char* name : {"EMBER_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (*end != '\0' || n < 0)
      throw UsageError(std::string(name) + "='" + v + "' is not a restart count (a non-negative integer); unset it or fix the launcher");
    return {n, std::string(name) + "=" + v};
  }
  return {0, ""};
}

int run(int argc, char** argv) {
  po::options_description opts("options");
  opts.add_options()
      ("help,h", "show this help")
      ("version", "print the engine and SDK versions")
      ("plugins,p", po::value<std::vector<std::string>>()->composing(), "plugins to load, comma-separated (repeatable)")
      ("set,s", po::value<std::vector<std::string>>()->composing(), "override a config value: section.key=value (repeatable)")
      ("resume", po::value<std::string>(), "resume training: last (auto: the same; from scratch when there is none), best, or a checkpoint file; a job torchrun or SLURM restarted resumes from last by itself")
      ("ckpt", po::value<std::string>(), "engine validate/test/predict/generate: the weights to evaluate: best, last, or a checkpoint file")
      ("plugin-path", po::value<std::vector<std::string>>()->composing(), "extra folder to search for plugins (repeatable)")
      ("output,o", po::value<std::string>(), "engine plot: the PNG file to write")
      ("format", po::value<std::string>()->default_value("safetensors"), "engine export: the format to write (safetensors: the model's weights; peft: the adapters alone)")
      ("prompt", po::value<std::string>(), "engine generate: the text to continue (default: standard input)")
      ("max-new-tokens", po::value<int64_t>()->default_value(200), "engine generate: tokens to sample after the prompt")
      ("temperature", po::value<double>()->default_value(0.8, "0.8"), "engine generate: sampling temperature; 0 = greedy (always the most likely token)")
      ("top-k", po::value<int64_t>()->default_value(0), "engine generate: sample among the k most likely tokens; 0 = all")
      ("top-p", po::value<double>()->default_value(1.0, "1"), "engine generate: sample among the most likely tokens holding this much probability (nucleus); 1 = all")
      ("seed", po::value<uint64_t>()->default_value(1337), "engine generate: seed of the sampling; engine data pack: seed of the samples' order")
      ("max-count", po::value<int64_t>()->default_value(10000), "engine data pack: samples per shard at most")
      ("max-mb", po::value<double>()->default_value(1024), "engine data pack: megabytes per shard at most")
      ("no-shuffle", "engine data pack: keep the source's order (torchvision's) instead of shuffling the samples")
      ("prefix", po::value<std::string>(), "engine data pack: the shards' file name prefix (default: the source's name)")
      ("weights-only", "engine checkpoint consolidate: write the model's weights alone (what save_weights_only writes), not the optimizer's state or the training position")
      ("no-kv-cache", "engine generate: run the whole sequence again for every token instead of caching keys and values (slow; a check)")
      ("quiet,q", "only warnings and errors")
      ("verbose,v", "debug output");
  po::options_description hidden;
  hidden.add_options()("args", po::value<std::vector<std::string>>(), "command and files");
  po::options_description all;
  all.add(opts).add(hidden);
  po::positional_options_description pos;
  pos.add("args", -1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(all).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(std::string(e.what()) + " (engine --help shows the usage)");
  }
  if (vm.count("help")) {
    std::cout << kUsage << "\n" << opts;
    return 0;
  }
  if (vm.count("version")) {
    std::cout << "engine " << kEmberVersion << " (sdk abi " << EMBER_SDK_ABI_MAJOR << "." << EMBER_SDK_ABI_MINOR
              << ", libtorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "." << TORCH_VERSION_PATCH << ")\n";
    return 0;
  }
  ember::log::init(0, vm.count("quiet") ? ember::log::Level::warn
                      : vm.count("verbose") ? ember::log::Level::debug
                                            : ember::log::Level::info);
  auto args = vm.count("args") ? vm["args"].as<std::vector<std::string>>() : std::vector<std::string>{};
  auto list = [&](const char* key) {
    return vm.count(key) ? vm[key].as<std::vector<std::string>>() : std::vector<std::string>{};
  };
  RunRequest req;
  req.plugins = split_commas(list("plugins"));
  req.sets = list("set");
  req.plugin_paths = list("plugin-path");
  if (vm.count("resume")) req.resume = vm["resume"].as<std::string>();
  req.argv.assign(argv, argv + argc);

  if (args.empty()) throw UsageError(std::string("no config file given\n") + kUsage);
  if (args[0] == "plugins") {
    if (args.size() == 2 && args[1] == "list") return list_plugins(req.plugin_paths, std::cout);
    if (args.size() == 3 && args[1] == "info") return plugin_info(args[2], req.plugin_paths, std::cout);
    throw UsageError("expected `engine plugins list` or `engine plugins info NAME`");
  }
  if (args[0] == "checkpoint") {
    if (args.size() == 4 && args[1] == "consolidate") return consolidate_checkpoint(req, args[2], args[3], vm.count("weights-only") > 0);
    if (args.size() == 3 && args[1] == "info") return checkpoint_info(args[2], std::cout);
    if (args.size() == 3 && args[1] == "verify") return checkpoint_verify(args[2], std::cout);
    throw UsageError("expected `engine checkpoint consolidate DIR OUT.ckpt [--weights-only]`, `engine checkpoint info CKPT` or `engine checkpoint verify CKPT`");
  }
  if (args[0] == "export") {
    if (args.size() != 3) throw UsageError("expected `engine export CKPT --format safetensors OUT` (OUT: a folder, or a file ending in .safetensors)");
    return export_weights(req, args[1], vm["format"].as<std::string>(), args[2]);
  }
  if (args[0] == "data") {
    if (args.size() != 4 || args[1] != "pack") throw UsageError("expected `engine data pack SOURCE OUT_DIR` (SOURCE: an image folder or a .csv/.jsonl list)");
    PackOptions pack;
    pack.max_count = vm["max-count"].as<int64_t>();
    pack.max_mb = vm["max-mb"].as<double>();
    pack.seed = vm["seed"].as<uint64_t>();
    pack.shuffle = vm.count("no-shuffle") == 0;
    if (vm.count("prefix")) pack.prefix = vm["prefix"].as<std::string>();
    return pack_images(args[2], args[3], pack, std::cout);
  }
  if (args[0] == "plot")
    return plot_runs(std::vector<std::string>(args.begin() + 1, args.end()),
                     vm.count("output") ? vm["output"].as<std::string>() : std::string(), std::cout);
  if (args[0] == "config") {
    if (args.size() != 2) throw UsageError("expected `engine config run.toml`");
    req.config_path = args[1];
    return print_config(req, std::cout);
  }
  if (args[0] == "validate" || args[0] == "test" || args[0] == "predict") {
    if (args.size() != 2) throw UsageError("expected `engine " + args[0] + " [--ckpt best|last|PATH] run.toml`");
    if (!req.resume.empty()) throw UsageError("--resume continues training; `engine " + args[0] + "` takes --ckpt best|last|PATH");
    req.config_path = args[1];
    return evaluate_checkpoint(req, args[0] == "test" ? ember::Split::test : ember::Split::val,
                               vm.count("ckpt") ? vm["ckpt"].as<std::string>() : std::string(), args[0] == "predict");
  }
  if (args[0] == "generate") {
    if (args.size() != 2) throw UsageError("expected `engine generate [--ckpt best|last|PATH] [--prompt TEXT] run.toml`");
    if (!req.resume.empty()) throw UsageError("--resume continues training; `engine generate` takes --ckpt best|last|PATH");
    req.config_path = args[1];
    GenerationOptions g;
    if (vm.count("prompt")) {
      g.prompt = vm["prompt"].as<std::string>();
    } else {
      std::ostringstream in;
      in << std::cin.rdbuf();
      g.prompt = in.str();
      // A prompt typed or piped as a line ends with the line's newline, which is not part of it.
      if (!g.prompt.empty() && g.prompt.back() == '\n') g.prompt.pop_back();
    }
    g.max_new_tokens = vm["max-new-tokens"].as<int64_t>();
    g.temperature = vm["temperature"].as<double>();
    g.top_k = vm["top-k"].as<int64_t>();
    g.top_p = vm["top-p"].as<double>();
    g.seed = vm["seed"].as<uint64_t>();
    g.use_cache = vm.count("no-kv-cache") == 0;
    if (g.max_new_tokens < 0) throw UsageError("--max-new-tokens " + std::to_string(g.max_new_tokens) + ": give 0 or more");
    if (!(g.temperature >= 0.0)) throw UsageError("--temperature " + std::to_string(g.temperature) + ": give 0 (greedy) or more");
    if (g.top_k < 0) throw UsageError("--top-k " + std::to_string(g.top_k) + ": give 0 (all tokens) or more");
    if (!(g.top_p > 0.0 && g.top_p <= 1.0)) throw UsageError("--top-p " + std::to_string(g.top_p) + ": give a probability in (0, 1]");
    return generate_text(req, vm.count("ckpt") ? vm["ckpt"].as<std::string>() : std::string(), g);
  }
  if (vm.count("ckpt")) throw UsageError("--ckpt is for `engine validate|test|predict`; to continue training from a checkpoint use --resume");
  if (args.size() != 1) {
    // `--set trainer.max_epochs 3` leaves "3" behind as an argument: name the --set that lost its value.
    // (No argument at all was answered with the usage above.)
    for (const auto& set : req.sets)
      if (set.find('=') == std::string::npos)
        throw UsageError("--set " + set + ": expected section.key=value (--set " + set + "=" + args.front() + ", one word, no spaces)");
    std::string given;
    for (const auto& a : args) given += " '" + a + "'";
    throw UsageError("expected one config file, got " + std::to_string(args.size()) + " arguments:" + given);
  }
  req.config_path = args[0];
  // A job its agent restarted (torchrun's elastic agent, SLURM's requeue) resumes by itself from
  // its newest run's last checkpoint, or starts from scratch when it never saved one: what
  // `--resume last` (or its alias `auto`) does.
  if (req.resume == "auto") req.resume = "last";
  if (req.resume.empty()) {
    if (const auto [restart, variable] = restart_attempt(); restart > 0) {
      ember::log::info("restart " + std::to_string(restart) + " of this job (" + variable + "): resuming from its last checkpoint (--resume last)");
      req.resume = "last";
    }
  }
  return run_training(req);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    ember::log::error(e.what());
    return 2;
  } catch (const ember::ConfigError& e) {
    ember::log::error(e.what());
    return 2;
  } catch (const PluginError& e) {
    ember::log::error(e.what());
    return 2;
  } catch (const c10::Error& e) {
    ember::log::error(std::string("run failed: ") + e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    ember::log::error(std::string("run failed: ") + e.what());
    return 1;
  }
}
